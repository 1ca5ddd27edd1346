//! One door to everything (ARCHITECTURE.md, "Crates"): a library crate's root either keeps
//! a module private and re-exports what it offers, or makes it a public namespace and
//! re-exports none of it, so no item is reachable by two paths of one crate; and no root
//! re-exports a whole other crate with a glob. This reads every workspace crate's `lib.rs`
//! (it lives here because this crate builds in seconds), so a second door fails here,
//! naming the crate and the module, instead of slipping in.

use std::path::Path;

/// The workspace's library crates, by folder (`.` is the `regatta` facade; the Python
/// package's native module offers nothing to Rust).
const CRATES: &[&str] = &[
    ".",
    "proto",
    "object-store",
    "net",
    "runtime",
    "trainer",
    "torch",
    "scorer",
];

/// The root's statements (comments dropped), each up to its `;`.
fn statements(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join(" ");
    code.split(';')
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect()
}

/// Each problem of one crate root: a `pub use` of a public module's items, or a glob
/// re-export of another crate.
fn second_doors(text: &str) -> Vec<String> {
    let statements = statements(text);
    let public: Vec<String> = statements
        .iter()
        .filter_map(|s| s.rsplit_once("pub mod ").map(|(_, name)| name.trim().to_string()))
        .filter(|name| !name.contains(' ') && !name.is_empty())
        .collect();
    let mut found = Vec::new();
    for statement in &statements {
        let Some((_, path)) = statement.split_once("pub use ") else {
            continue;
        };
        let path = path.trim().trim_start_matches("self::");
        let first = path.split("::").next().unwrap_or_default();
        if public.iter().any(|m| m == first) && path.contains("::") {
            found.push(format!(
                "`pub use {path}` re-exports from `pub mod {first}`: make the module private or drop the re-export"
            ));
        }
        if path.ends_with("::*") && (path.starts_with("regatta") || path.starts_with("::")) {
            found.push(format!(
                "`pub use {path}` re-exports a whole crate: list what users need"
            ));
        }
    }
    found
}

#[test]
fn no_library_root_offers_an_item_by_two_paths() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut problems = Vec::new();
    for name in CRATES {
        let lib = workspace.join(name).join("src/lib.rs");
        let text = std::fs::read_to_string(&lib).unwrap_or_else(|e| panic!("cannot read {}: {e}", lib.display()));
        assert!(
            text.contains("pub use"),
            "{} re-exports nothing: is this the right file?",
            lib.display()
        );
        problems.extend(
            second_doors(&text)
                .into_iter()
                .map(|p| format!("{name}/src/lib.rs: {p}")),
        );
    }
    assert!(problems.is_empty(), "two doors:\n{}", problems.join("\n"));
}

#[test]
fn the_check_sees_a_second_door_and_a_glob() {
    let root = "pub mod plan; // a namespace\nmod zero;\npub use plan::Plan;\npub use zero::{Piece,\n    Stage};\n";
    let found = second_doors(root);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("pub mod plan"), "{found:?}");
    assert_eq!(second_doors("pub use regatta_runtime::*;\n").len(), 1);
    assert!(second_doors("mod a;\npub use a::{B, C};\npub use tch;\n").is_empty());
}
