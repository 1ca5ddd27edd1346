//! Records where libtorch was found as the binaries' run path, so they start without
//! LD_LIBRARY_PATH; setting LD_LIBRARY_PATH still wins (a CUDA libtorch on a GPU host).
//! Also hands the libtorch version of the headers to the code (`cuda::BUILT_AGAINST`), for
//! `regatta-torch-rank doctor`.
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let mut built = "unknown".to_string();
    if let Ok(libtorch) = std::env::var("LIBTORCH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libtorch}/lib");
        let header = format!("{libtorch}/include/torch/headeronly/version.h");
        println!("cargo:rerun-if-changed={header}");
        if let Ok(text) = std::fs::read_to_string(&header) {
            let part = |name: &str| {
                text.lines()
                    .find_map(|l| l.trim().strip_prefix(&format!("#define TORCH_VERSION_{name} ")))
                    .map(|v| v.trim().to_string())
            };
            if let (Some(major), Some(minor), Some(patch)) = (part("MAJOR"), part("MINOR"), part("PATCH")) {
                built = format!("{major}.{minor}.{patch}");
            }
        }
    }
    println!("cargo:rustc-env=REGATTA_LIBTORCH_BUILT={built}");
}
