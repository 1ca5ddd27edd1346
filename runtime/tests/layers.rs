//! The runtime's folders import one way (ARCHITECTURE.md, "Inside runtime/"): each names
//! only the folders below it. This reads the crate's own sources, so an import against the
//! direction fails here, naming the file and the line, instead of slipping in.

use std::path::{Path, PathBuf};

/// From the bottom up; a folder may use those in earlier rows, not those in its own row
/// or later ones.
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["environment"],
    &["executor"],
    &["net"],
    &["objects"],
    &["metrics"],
    &["client"],
    &["jobs"],
    &["worker", "head"],
];

/// Names the crate root re-exports from its own `error` module.
const ROOT_ERROR_NAMES: &[&str] = &["Error", "Result"];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|row| row.contains(&module))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without its comments and its `#[cfg(test)]` module, line by line.
fn code_lines(text: &str) -> Vec<(usize, String)> {
    let mut lines = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let next = text.lines().nth(number + 1).unwrap_or_default();
        if line.trim_start() == "#[cfg(test)]" && next.starts_with("mod ") && next.trim_end().ends_with('{') {
            break;
        }
        let code = line.split("//").next().unwrap_or_default();
        if !code.trim().is_empty() {
            lines.push((number + 1, code.to_string()));
        }
    }
    lines
}

/// Every `crate::name` a line names.
fn crate_paths(line: &str) -> Vec<String> {
    line.match_indices("crate::")
        .filter(|(at, _)| !line[..*at].ends_with(|c: char| c.is_alphanumeric() || c == '_'))
        .map(|(at, m)| {
            line[at + m.len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

/// What breaks the direction in the crate at `src`: one line per import.
fn violations(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    sources(src, &mut files);
    assert!(
        files.len() > 20,
        "read only {} files under {}",
        files.len(),
        src.display()
    );
    let mut found = Vec::new();
    for file in files {
        let relative = file.strip_prefix(src).expect("under src").to_path_buf();
        if relative.file_name().is_some_and(|n| n == "tests.rs") || relative == Path::new("lib.rs") {
            continue;
        }
        let top = relative
            .components()
            .next()
            .expect("a component")
            .as_os_str()
            .to_string_lossy();
        let module = top.trim_end_matches(".rs").to_string();
        let Some(own) = layer_of(&module) else {
            found.push(format!(
                "{}: folder '{module}' is in no layer of this test",
                relative.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(&file).expect("read a source file");
        for (number, line) in code_lines(&text) {
            if line.contains("super::super::") {
                found.push(format!(
                    "{}:{number}: reaches out of its folder with super::super",
                    relative.display()
                ));
            }
            for name in crate_paths(&line) {
                if name == module {
                    continue;
                }
                if ROOT_ERROR_NAMES.contains(&name.as_str()) {
                    continue;
                }
                match layer_of(&name) {
                    Some(layer) if layer < own => {}
                    Some(_) => found.push(format!(
                        "{}:{number}: '{module}' imports 'crate::{name}', which is not below it",
                        relative.display()
                    )),
                    None => found.push(format!(
                        "{}:{number}: 'crate::{name}' goes through the crate root's re-exports; name the folder",
                        relative.display()
                    )),
                }
            }
        }
    }
    found
}

#[test]
fn folders_import_only_the_folders_below_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = violations(&src);
    assert!(
        found.is_empty(),
        "imports against the runtime's direction (ARCHITECTURE.md):\n{}",
        found.join("\n")
    );
}

#[test]
fn an_import_against_the_direction_is_caught() {
    let dir = std::env::temp_dir().join(format!("regatta-layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (file, text) in (0..20).map(|n| (format!("error{n}.rs"), String::new())).chain([
        (
            "net/mod.rs".to_string(),
            "use crate::worker::router::Routes;\n".to_string(),
        ),
        (
            "net/ok.rs".to_string(),
            "use crate::error::Result; // crate::head in a comment\n".to_string(),
        ),
        (
            "worker/mod.rs".to_string(),
            "use crate::head::api;\nuse crate::Cluster;\n".to_string(),
        ),
        (
            "head/mod.rs".to_string(),
            "use crate::net::wire;\n#[cfg(test)]\nmod tests {\n    use crate::worker::x;\n}\n".to_string(),
        ),
    ]) {
        let path = dir.join(if file.starts_with("error") {
            format!("error/{file}")
        } else {
            file
        });
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("create a folder");
        std::fs::write(&path, text).expect("write a source file");
    }
    let found = violations(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(found.len(), 3, "{found:#?}");
    assert!(
        found
            .iter()
            .any(|v| v.starts_with("net/mod.rs:1: 'net' imports 'crate::worker'")),
        "{found:#?}"
    );
    assert!(
        found
            .iter()
            .any(|v| v.starts_with("worker/mod.rs:1: 'worker' imports 'crate::head'")),
        "{found:#?}"
    );
    assert!(
        found
            .iter()
            .any(|v| v.contains("'crate::Cluster' goes through the crate root")),
        "{found:#?}"
    );
}
