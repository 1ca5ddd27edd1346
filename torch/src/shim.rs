//! Safe wrappers over `src/shim/shim.cpp`: libtorch calls tch 0.24 does not bind.
//! FlashAttention's variable-length forward (packed documents, no dense mask), the TF32
//! switch for float32 matmuls, and which SDPA kernels are enabled.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, CStr};

use tch::{TchError, Tensor};
use torch_sys::C_tensor;

extern "C" {
    fn regatta_flash_varlen(
        query: *const C_tensor,
        key: *const C_tensor,
        value: *const C_tensor,
        cu_seqlens: *const C_tensor,
        max_len: i64,
        scale: f64,
        window_left: i64,
        out: *mut *mut C_tensor,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
    fn regatta_allow_tf32(allow: c_int);
    fn regatta_sdp_enabled(flash: *mut c_int, efficient: *mut c_int, math: *mut c_int, cudnn: *mut c_int);
}

/// Causal attention over packed documents with FlashAttention's variable-length kernel
/// (CUDA, f16/bf16): `query` `[total, heads, dim]`, `key`/`value` `[total, kv_heads, dim]`,
/// `cu_seqlens` int32 `[documents + 1]` on the same device; `window_left`: how many earlier
/// keys a query sees (Mistral's sliding window minus one), `None` for all. Differentiable:
/// libtorch records the kernel's backward.
pub fn flash_varlen(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    cu_seqlens: &Tensor,
    max_len: i64,
    scale: f64,
    window_left: Option<i64>,
) -> Result<Tensor, TchError> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let mut error = [0 as c_char; 1024];
    // SAFETY: the tensor handles are live for the call; `out` and `error` are valid
    // out-pointers; the shim catches every C++ exception.
    let status = unsafe {
        regatta_flash_varlen(
            query.as_ptr(),
            key.as_ptr(),
            value.as_ptr(),
            cu_seqlens.as_ptr(),
            max_len,
            scale,
            window_left.unwrap_or(-1),
            &mut out,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    if status != 0 || out.is_null() {
        // SAFETY: the shim wrote a NUL-terminated string into `error` (zeroed before).
        let text = unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned();
        return Err(TchError::Torch(text));
    }
    // SAFETY: `out` is a fresh heap at::Tensor the shim made for us to own.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Lets float32 matmuls on CUDA use TF32 tensor cores (`torch.set_float32_matmul_precision
/// ("high")`), or not.
pub fn allow_tf32(allow: bool) {
    // SAFETY: sets a flag on libtorch's global context.
    unsafe { regatta_allow_tf32(c_int::from(allow)) }
}

/// Which SDPA kernels libtorch may use: (flash, memory-efficient, math, cuDNN).
pub fn sdp_enabled() -> (bool, bool, bool, bool) {
    let (mut flash, mut efficient, mut math, mut cudnn) = (0, 0, 0, 0);
    // SAFETY: four valid out-pointers.
    unsafe { regatta_sdp_enabled(&mut flash, &mut efficient, &mut math, &mut cudnn) };
    (flash != 0, efficient != 0, math != 0, cudnn != 0)
}
