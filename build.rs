//! Puts the native libraries on the rpath of this package's binaries, tests and examples (see kiln-build).

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: std::env::var_os("CARGO_FEATURE_TORCH").is_some(),
        tensorflow: std::env::var_os("CARGO_FEATURE_TF").is_some(),
    });
}
