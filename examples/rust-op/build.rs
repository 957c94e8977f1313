//! The libraries' directories on the binaries' rpath: no C++ to compile here.

fn main() {
    kiln_build::build_script(kiln_build::Native {
        torch: true,
        tensorflow: true,
    });
}
