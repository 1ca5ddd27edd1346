//! Records where libtorch was found as the binaries' run path, so they start without
//! LD_LIBRARY_PATH; setting LD_LIBRARY_PATH still wins (a CUDA libtorch on a GPU host).
//! Also hands the libtorch version of the headers to the code (`cuda::BUILT_AGAINST`), for
//! `regatta-torch-rank doctor`.
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let mut built = "unknown".to_string();
    println!("cargo:rerun-if-changed=src/shim/shim.cpp");
    println!("cargo:rerun-if-changed=src/shim/paged_attention.cpp");
    println!("cargo:rerun-if-changed=src/shim/panel_linear.cpp");
    println!("cargo:rerun-if-changed=src/shim/rms_norm.cpp");
    println!("cargo:rerun-if-changed=src/shim/errors.h");
    if let Ok(libtorch) = std::env::var("LIBTORCH") {
        // The calls tch does not bind (torch/src/shim.rs), against the same headers and C++
        // ABI as torch-sys's own glue.
        cc::Build::new()
            .cpp(true)
            .pic(true)
            .warnings(false)
            .include(format!("{libtorch}/include"))
            .include(format!("{libtorch}/include/torch/csrc/api/include"))
            .flag("-std=c++17")
            .flag(format!(
                "-D_GLIBCXX_USE_CXX11_ABI={}",
                std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_string())
            ))
            // Optimized in every profile: the kernels run in debug tests too.
            .opt_level(3)
            // at::parallel_for is a header template over `#pragma omp parallel`: without
            // OpenMP it runs on one thread. It then calls libtorch's own libgomp.
            .flag("-fopenmp")
            // No product fused into an add unless a kernel asks for it by intrinsic: the
            // rotary embedding must round as libtorch's separate ops do.
            .flag("-ffp-contract=off")
            .file("src/shim/shim.cpp")
            .file("src/shim/paged_attention.cpp")
            .file("src/shim/panel_linear.cpp")
            .file("src/shim/rms_norm.cpp")
            .compile("regatta_torch_shim");
        println!("cargo:rustc-link-search=native={libtorch}/lib");
        println!("cargo:rustc-link-lib=dylib:+verbatim=libgomp.so.1");
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
