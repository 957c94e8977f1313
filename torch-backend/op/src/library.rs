//! [`torch_library!`](crate::torch_library): ops registered when a shared
//! library is loaded.

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::kernel::panic_message;

/// Registers Rust ops in libtorch when the shared library (a `cdylib`) that
/// expands it is loaded, as a C++ op library's static `TORCH_LIBRARY`
/// initialisers do: Python then loads it with `torch.ops.load_library(path)`
/// and calls `torch.ops.<namespace>.<name>`; TorchScript code and
/// `torch.library.opcheck` see the ops like any other.
///
/// It emits a constructor in the `.init_array` section (run by the dynamic
/// loader, after libtorch, which the library links, is initialised) that calls
/// [`register`](crate::register) for each op in order. An error (an op of that
/// name already defined, say by loading the library twice under two paths) is
/// written to standard error, the only channel at load time, and the other
/// ops are still registered. Build the `cdylib` with `kiln-torch-op`'s default
/// features off, so it links libtorch alone, not `tch`:
///
/// ```toml
/// [lib]
/// crate-type = ["cdylib"]
///
/// [dependencies]
/// kiln-torch-op = { workspace = true, default-features = false }
/// ```
///
/// ```ignore
/// // src/lib.rs of the cdylib
/// kiln_torch_op::torch_library!(my_ops::RmsNorm, my_ops::RmsNormBackward);
/// ```
///
/// ```python
/// torch.ops.load_library("target/release/libmy_ops.so")
/// y = torch.ops.my_ns.rms_norm(x, w, eps=1e-5)
/// ```
///
/// Linux (ELF) only, like the rest of Kiln's native builds.
#[macro_export]
macro_rules! torch_library {
    ($($op:ty),+ $(,)?) => {
        const _: () = {
            extern "C" fn kiln_torch_library_init() {
                $crate::__register_at_load(&[$(
                    (
                        ::std::any::type_name::<$op>,
                        $crate::register::<$op> as fn() -> _,
                    )
                ),+]);
            }
            #[used]
            #[unsafe(link_section = ".init_array")]
            static KILN_TORCH_LIBRARY_INIT: extern "C" fn() = kiln_torch_library_init;
        };
    };
}

/// A registration for [`__register_at_load`]: the op type's name, and its
/// `register` function.
#[doc(hidden)]
pub type Registration = (fn() -> &'static str, fn() -> kiln_core::Result<()>);

/// What [`torch_library!`](crate::torch_library) runs at load time: registers
/// each op, reporting failures (and panics) on standard error, never unwinding.
#[doc(hidden)]
pub fn __register_at_load(ops: &[Registration]) {
    for (type_name, register) in ops {
        let outcome = catch_unwind(AssertUnwindSafe(register));
        let problem = match outcome {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => e.display_chain().to_string(),
            Err(payload) => format!("panicked: {}", panic_message(payload.as_ref())),
        };
        // Nothing else can report at load time; a failed write is ignored.
        let _ = writeln!(
            std::io::stderr(),
            "kiln-torch-op: cannot register {} in libtorch: {problem}",
            type_name()
        );
    }
}
