//! Tensors as the stable C ABI hands them over: owned `AtenTensorHandle`s.

use std::ffi::c_void;

use crate::sys::{self, AtenTensorHandle};

/// An owned `at::Tensor*` (one reference to a tensor), freed on drop with
/// `aoti_torch_delete_tensor_object`.
#[derive(Debug)]
pub(crate) struct OwnedTensor(AtenTensorHandle);

/// A failed shim call, as a message (the shim returns only a code; it printed
/// libtorch's message on stderr).
fn check(rc: sys::AOTITorchError, what: &str) -> Result<(), String> {
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("libtorch failed to {what} (error code {rc})"))
    }
}

impl OwnedTensor {
    /// Takes ownership of `handle`.
    ///
    /// # Safety
    ///
    /// `handle` is a live tensor handle that nothing else frees (an input the
    /// dispatcher handed a kernel, or a new reference a shim function returned).
    pub(crate) unsafe fn from_raw(handle: AtenTensorHandle) -> Self {
        OwnedTensor(handle)
    }

    /// Gives up ownership: the caller (libtorch, for a kernel's outputs) frees it.
    pub(crate) fn into_raw(self) -> AtenTensorHandle {
        let handle = self.0;
        std::mem::forget(self);
        handle
    }

    /// Reads an `i32` property with a shim getter.
    fn query_i32(
        &self,
        getter: unsafe extern "C" fn(AtenTensorHandle, *mut i32) -> sys::AOTITorchError,
        what: &str,
    ) -> Result<i32, String> {
        let mut value = 0;
        // SAFETY: `self.0` is a live handle (owned by `self`) and `value` a
        // valid out-pointer for the getter's result.
        check(unsafe { getter(self.0, &mut value) }, what)?;
        Ok(value)
    }

    /// The dtype code (`aoti_torch_dtype_*`).
    pub(crate) fn dtype(&self) -> Result<i32, String> {
        self.query_i32(sys::aoti_torch_get_dtype, "read a tensor's dtype")
    }

    /// The device type code (`aoti_torch_device_type_*`).
    pub(crate) fn device_type(&self) -> Result<i32, String> {
        self.query_i32(sys::aoti_torch_get_device_type, "read a tensor's device")
    }

    /// The device index.
    pub(crate) fn device_index(&self) -> Result<i32, String> {
        self.query_i32(
            sys::aoti_torch_get_device_index,
            "read a tensor's device index",
        )
    }

    /// The sizes.
    pub(crate) fn sizes(&self) -> Result<Vec<i64>, String> {
        let mut dim = 0i64;
        let mut sizes: *mut i64 = std::ptr::null_mut();
        // SAFETY: a live handle and valid out-pointers.
        let rc = unsafe { sys::aoti_torch_get_dim(self.0, &mut dim) };
        check(rc, "read a tensor's rank")?;
        // SAFETY: as above; `sizes` is borrowed from the tensor, which `self` keeps alive.
        let rc = unsafe { sys::aoti_torch_get_sizes(self.0, &mut sizes) };
        check(rc, "read a tensor's sizes")?;
        let dim = usize::try_from(dim).map_err(|_| format!("a tensor reports rank {dim}"))?;
        if dim == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: libtorch returned `dim` sizes at `sizes`, valid while the
        // tensor lives; they are copied out at once.
        Ok(unsafe { std::slice::from_raw_parts(sizes, dim) }.to_vec())
    }

    /// Whether the elements are contiguous in row-major order.
    pub(crate) fn is_contiguous(&self) -> Result<bool, String> {
        let mut contiguous = false;
        // SAFETY: a live handle and a valid out-pointer.
        let rc = unsafe { sys::aoti_torch_is_contiguous(self.0, &mut contiguous) };
        check(rc, "read a tensor's layout")?;
        Ok(contiguous)
    }

    /// A contiguous tensor with the same elements (`aten::contiguous`).
    pub(crate) fn contiguous(&self) -> Result<OwnedTensor, String> {
        let mut copy: AtenTensorHandle = std::ptr::null_mut();
        // SAFETY: a live handle and a valid out-pointer; the new reference is
        // owned by the OwnedTensor made of it just below.
        let rc = unsafe { sys::aoti_torch_new_tensor_handle(self.0, &mut copy) };
        check(rc, "reference a tensor")?;
        // SAFETY: a fresh reference that nothing else owns.
        let reference = unsafe { OwnedTensor::from_raw(copy) };
        // The dispatcher's stack for `contiguous(Tensor self, *, MemoryFormat
        // memory_format)`: it steals the tensor reference and writes back a new one.
        // SAFETY: takes no arguments, returns a constant.
        let format = unsafe { sys::aoti_torch_memory_format_contiguous_format() };
        let mut stack = [reference.into_raw() as u64, format as u32 as u64];
        // SAFETY: a NUL-terminated op and overload name and a stack of the two
        // arguments the schema takes (one return fits in it).
        let rc = unsafe {
            sys::torch_call_dispatcher(
                c"aten::contiguous".as_ptr(),
                c"".as_ptr(),
                stack.as_mut_ptr(),
                sys::TORCH_ABI_VERSION,
            )
        };
        check(rc, "make a tensor contiguous")?;
        // SAFETY: on success the dispatcher wrote a new owned reference at stack[0].
        Ok(unsafe { OwnedTensor::from_raw(stack[0] as usize as AtenTensorHandle) })
    }

    /// The address of the first element (of the tensor's own offset).
    pub(crate) fn data_ptr(&self) -> Result<*mut c_void, String> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: a live handle and a valid out-pointer.
        let rc = unsafe { sys::aoti_torch_get_data_ptr(self.0, &mut ptr) };
        check(rc, "read a tensor's data pointer")?;
        Ok(ptr)
    }

    /// A new contiguous tensor of `sizes` (uninitialised).
    pub(crate) fn empty(
        sizes: &[i64],
        dtype: i32,
        device_type: i32,
        device_index: i32,
    ) -> Result<OwnedTensor, String> {
        let mut strides = vec![1i64; sizes.len()];
        for i in (0..sizes.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * sizes[i + 1].max(1);
        }
        let mut handle: AtenTensorHandle = std::ptr::null_mut();
        // SAFETY: `sizes` and `strides` hold `sizes.len()` elements each; the
        // result is a new reference, owned by the OwnedTensor below.
        let rc = unsafe {
            sys::aoti_torch_empty_strided(
                sizes.len() as i64,
                sizes.as_ptr(),
                strides.as_ptr(),
                dtype,
                device_type,
                device_index,
                &mut handle,
            )
        };
        check(rc, &format!("allocate a tensor of shape {sizes:?}"))?;
        // SAFETY: a fresh reference that nothing else owns.
        Ok(unsafe { OwnedTensor::from_raw(handle) })
    }
}

impl Drop for OwnedTensor {
    fn drop(&mut self) {
        // SAFETY: `self.0` is a live reference owned by `self`, freed once here.
        // A failure (never seen) leaves a tensor alive; nothing to do in drop.
        let _ = unsafe { sys::aoti_torch_delete_tensor_object(self.0) };
    }
}

/// The name of a dtype code, as PyTorch writes it.
pub(crate) fn dtype_name(code: i32) -> String {
    let table: [(unsafe extern "C" fn() -> i32, &str); 12] = [
        (sys::aoti_torch_dtype_float32, "float32"),
        (sys::aoti_torch_dtype_float64, "float64"),
        (sys::aoti_torch_dtype_float16, "float16"),
        (sys::aoti_torch_dtype_bfloat16, "bfloat16"),
        (sys::aoti_torch_dtype_int64, "int64"),
        (sys::aoti_torch_dtype_int32, "int32"),
        (sys::aoti_torch_dtype_int16, "int16"),
        (sys::aoti_torch_dtype_int8, "int8"),
        (sys::aoti_torch_dtype_uint8, "uint8"),
        (sys::aoti_torch_dtype_bool, "bool"),
        (sys::aoti_torch_dtype_complex64, "complex64"),
        (sys::aoti_torch_dtype_complex128, "complex128"),
    ];
    table
        .iter()
        // SAFETY: each is a shim function without arguments returning a constant.
        .find(|(f, _)| unsafe { f() } == code)
        .map_or_else(|| format!("dtype {code}"), |(_, name)| (*name).to_owned())
}

/// The name of a device type code.
pub(crate) fn device_name(code: i32) -> String {
    let table: [(unsafe extern "C" fn() -> i32, &str); 3] = [
        (sys::aoti_torch_device_type_cpu, "cpu"),
        (sys::aoti_torch_device_type_cuda, "cuda"),
        (sys::aoti_torch_device_type_meta, "meta"),
    ];
    table
        .iter()
        // SAFETY: each is a shim function without arguments returning a constant.
        .find(|(f, _)| unsafe { f() } == code)
        .map_or_else(
            || format!("device type {code}"),
            |(_, name)| (*name).to_owned(),
        )
}
