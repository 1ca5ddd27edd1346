//! Records where libtorch was found as the binaries' run path, so they start without
//! LD_LIBRARY_PATH; setting LD_LIBRARY_PATH still wins (a CUDA libtorch on a GPU host).
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(libtorch) = std::env::var("LIBTORCH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libtorch}/lib");
    }
}
