//! Puts libtorch on the rpath of this crate's tests (see kiln-build).

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: true,
        tensorflow: false,
    });
}
