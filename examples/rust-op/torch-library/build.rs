//! Puts libtorch on the rpath of the shared library and the tests (see
//! kiln-build); kiln-torch-op's build links the library against libtorch.

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: true,
        tensorflow: false,
    });
}
