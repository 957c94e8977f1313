//! Compiles Kiln's JPEG decoding shim (`csrc/jpeg_decode.c`, with the SIMD
//! stages of `csrc/jpeg_simd.c`) against the libjpeg-turbo that
//! `mozjpeg-sys` builds from source with `cc`.

fn main() {
    let include = std::env::var_os("DEP_JPEG_INCLUDE")
        .expect("mozjpeg-sys exports its include directories as DEP_JPEG_INCLUDE");
    let mut build = cc::Build::new();
    for dir in std::env::split_paths(&include) {
        build.include(dir);
    }
    build
        .file("csrc/jpeg_decode.c")
        .file("csrc/jpeg_simd.c")
        .warnings(true)
        .opt_level(2)
        .compile("kiln_jpeg_decode");
    println!("cargo:rerun-if-changed=csrc/jpeg_decode.c");
    println!("cargo:rerun-if-changed=csrc/jpeg_simd.c");
}
