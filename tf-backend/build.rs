//! Puts the native libraries on the rpath of this package's binaries, tests and examples (see kiln-build).

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: false,
        tensorflow: true,
    });
}
