//! `regatta-proto` decides without I/O: it must not grow an async runtime, a network or
//! storage crate, or the actor framework. This reads its own manifest, so adding such a
//! dependency fails here with the reason instead of slipping in.

const ALLOWED: &[&str] = &["serde", "thiserror", "getrandom", "bytes"];

#[test]
fn the_pure_core_depends_only_on_data_crates() {
    let manifest =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).expect("read Cargo.toml");
    let mut section = String::new();
    let mut found = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_string();
            continue;
        }
        if section == "[dependencies]" && !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['=', '.']).next().unwrap_or_default().trim().to_string();
            found.push(name);
        }
    }
    assert!(!found.is_empty(), "no [dependencies] read from the manifest");
    for name in &found {
        assert!(
            ALLOWED.contains(&name.as_str()),
            "regatta-proto must stay free of I/O, runtimes and actors, but depends on '{name}'; \
             put what needs it in regatta-runtime"
        );
    }
}
