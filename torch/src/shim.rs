//! Safe wrappers over `src/shim/shim.cpp`: libtorch calls tch 0.24 does not bind.
//! Tensors over bytes read from a file without a copy, FlashAttention's variable-length
//! forward (packed documents, no dense mask), the TF32 switch for float32 matmuls, which
//! SDPA kernels are enabled, and the CUDA caching allocator's statistics.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr};

use bytes::{Bytes, BytesMut};
use tch::{Kind, TchError, Tensor};
use torch_sys::C_tensor;

extern "C" {
    fn regatta_tensor_over(
        data: *mut c_void,
        sizes: *const i64,
        dims: usize,
        like: *const C_tensor,
        context: *mut c_void,
        release: extern "C" fn(*mut c_void),
        out: *mut *mut C_tensor,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
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
    fn regatta_onednn_pack_linear(
        weight: *const C_tensor,
        batch_hint: i64,
        out: *mut *mut C_tensor,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
    fn regatta_onednn_linear(
        input: *const C_tensor,
        packed: *const C_tensor,
        bias: *const C_tensor,
        out: *mut *mut C_tensor,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
    #[cfg(test)]
    fn regatta_paged_attention(
        query: *const C_tensor,
        key_cache: *const C_tensor,
        value_cache: *const C_tensor,
        read: *const C_tensor,
        lengths: *const C_tensor,
        positions: *const C_tensor,
        window: i64,
        scale: f64,
        out: *mut *mut C_tensor,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
    fn regatta_rope_paged_attention(
        query: *const C_tensor,
        key: *const C_tensor,
        value: *const C_tensor,
        cos: *const C_tensor,
        sin: *const C_tensor,
        key_cache: *const C_tensor,
        value_cache: *const C_tensor,
        write: *const C_tensor,
        read: *const C_tensor,
        lengths: *const C_tensor,
        positions: *const C_tensor,
        offsets: *const C_tensor,
        window: i64,
        scale: f64,
        out: *mut *mut C_tensor,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
    #[cfg(test)]
    fn regatta_paged_attention_widest(level: c_int);
    fn regatta_panel_kernel_level() -> c_int;
    #[cfg(test)]
    fn regatta_panel_force_avx2(force: c_int);
    fn regatta_panel_linear(
        input: *const C_tensor,
        packed: *const C_tensor,
        out_width: i64,
        bias: *const C_tensor,
        out: *mut *mut C_tensor,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
    fn regatta_rms_norm(
        x: *const C_tensor,
        residual: *const C_tensor,
        weight: *const C_tensor,
        eps: f64,
        sum: *mut *mut C_tensor,
        normed: *mut *mut C_tensor,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
    fn regatta_allow_tf32(allow: c_int);
    fn regatta_sdp_enabled(flash: *mut c_int, efficient: *mut c_int, math: *mut c_int, cudnn: *mut c_int);
    fn regatta_cuda_memory(
        device: c_int,
        allocated: *mut i64,
        peak_allocated: *mut i64,
        reserved: *mut i64,
        peak_reserved: *mut i64,
        reset_peak: c_int,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
}

/// The CUDA caching allocator's bytes on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaMemory {
    /// Held by live tensors now.
    pub allocated: u64,
    /// Most held by live tensors since the last reset.
    pub peak_allocated: u64,
    /// Reserved from the driver now (allocated plus the cache).
    pub reserved: u64,
    /// Most reserved since the last reset.
    pub peak_reserved: u64,
}

/// The CUDA caching allocator's statistics for `device` (an ordinal as this process sees
/// it); with `reset_peak` the peaks start again after reading (per-step peaks).
pub fn cuda_memory(device: usize, reset_peak: bool) -> Result<CudaMemory, TchError> {
    let (mut allocated, mut peak_allocated, mut reserved, mut peak_reserved) = (0i64, 0i64, 0i64, 0i64);
    let mut error = [0 as c_char; 1024];
    // SAFETY: valid out-pointers and error buffer; the shim catches every C++ exception.
    let status = unsafe {
        regatta_cuda_memory(
            device as c_int,
            &mut allocated,
            &mut peak_allocated,
            &mut reserved,
            &mut peak_reserved,
            c_int::from(reset_peak),
            error.as_mut_ptr(),
            error.len(),
        )
    };
    if status != 0 {
        // SAFETY: the shim wrote a NUL-terminated string into `error` (zeroed before).
        let text = unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned();
        return Err(TchError::Torch(text));
    }
    let bytes = |v: i64| v.max(0) as u64;
    Ok(CudaMemory {
        allocated: bytes(allocated),
        peak_allocated: bytes(peak_allocated),
        reserved: bytes(reserved),
        peak_reserved: bytes(peak_reserved),
    })
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
    tensor_answer(status, out, &error)
}

/// A shim call's tensor: `out` when `status` is 0, else the error text it wrote.
fn tensor_answer(status: c_int, out: *mut C_tensor, error: &[c_char]) -> Result<Tensor, TchError> {
    if status != 0 || out.is_null() {
        // SAFETY: the shim wrote a NUL-terminated string into `error` (zeroed before).
        let text = unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned();
        return Err(TchError::Torch(text));
    }
    // SAFETY: `out` is a fresh heap at::Tensor the shim made for us to own.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Frees the bytes a tensor of [`tensor_from_bytes`] lay in (libtorch calls it once).
extern "C" fn release_bytes(context: *mut c_void) {
    // SAFETY: `context` is the `Box<BytesMut>` `tensor_from_bytes` leaked for the tensor;
    // the shim calls this exactly once.
    drop(unsafe { Box::from_raw(context.cast::<BytesMut>()) });
}

/// A contiguous CPU tensor of `kind` and `shape` holding `bytes` (native byte order, as a
/// safetensors file stores them), an error where their length is not the shape's. A model
/// file's tensors are read into fresh buffers: such a buffer (the only handle to its
/// memory, aligned for `kind`) becomes the tensor's storage as it is, freed with it;
/// any other is copied. A load of SmolLM2-135M copied 540 MB a second time before.
pub fn tensor_from_bytes(bytes: Bytes, shape: &[i64], kind: Kind) -> Result<Tensor, TchError> {
    let elements = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?));
    if elements.and_then(|n| n.checked_mul(kind.elt_size_in_bytes())) != Some(bytes.len()) {
        return Err(TchError::Shape(format!(
            "{} bytes do not hold a {kind:?} tensor of shape {shape:?}",
            bytes.len()
        )));
    }
    let aligned = (bytes.as_ptr() as usize).is_multiple_of(kind.elt_size_in_bytes().max(1));
    let owned = match bytes.try_into_mut() {
        Ok(owned) if aligned && !owned.is_empty() => owned,
        Ok(owned) => return Tensor::f_from_data_size(&owned, shape, kind),
        Err(shared) => return Tensor::f_from_data_size(&shared, shape, kind),
    };
    let mut owned = Box::new(owned);
    let data = owned.as_mut_ptr().cast::<c_void>();
    let context = Box::into_raw(owned).cast::<c_void>();
    // The kind, as libtorch numbers it (tch keeps its own numbering private).
    let like = Tensor::empty([0], (kind, tch::Device::Cpu));
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let mut error = [0 as c_char; 1024];
    // SAFETY: `data` holds exactly the shape's bytes (checked above), aligned for `kind`,
    // and stays valid until the shim calls `release_bytes(context)`, which it does exactly
    // once (on failure too); nothing else reads or writes the buffer meanwhile.
    let status = unsafe {
        regatta_tensor_over(
            data,
            shape.as_ptr(),
            shape.len(),
            like.as_ptr(),
            context,
            release_bytes,
            &mut out,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    tensor_answer(status, out, &error)
}

/// `weight` (`[out, in]`, float32, CPU; any strides) reordered once into oneDNN's blocked
/// layout for products of about `batch_hint` rows: an opaque tensor for [`onednn_linear`].
/// An error where this libtorch has no oneDNN.
pub fn onednn_pack_linear(weight: &Tensor, batch_hint: i64) -> Result<Tensor, TchError> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let mut error = [0 as c_char; 1024];
    // SAFETY: a live tensor handle and valid out-pointers; the shim catches C++ exceptions.
    let status =
        unsafe { regatta_onednn_pack_linear(weight.as_ptr(), batch_hint, &mut out, error.as_mut_ptr(), error.len()) };
    tensor_answer(status, out, &error)
}

/// `input [..., in] · Wᵀ + bias` by oneDNN against `packed` (from [`onednn_pack_linear`]);
/// a dense float32 output `[..., out]`.
pub fn onednn_linear(input: &Tensor, packed: &Tensor, bias: Option<&Tensor>) -> Result<Tensor, TchError> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let mut error = [0 as c_char; 1024];
    // SAFETY: live tensor handles (a null bias means none) and valid out-pointers; the
    // shim catches C++ exceptions.
    let status = unsafe {
        regatta_onednn_linear(
            input.as_ptr(),
            packed.as_ptr(),
            bias.map_or(std::ptr::null(), Tensor::as_ptr),
            &mut out,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    tensor_answer(status, out, &error)
}

/// The widest instructions [`paged_attention`] may use, for tests of each path on one
/// machine: 0 plain C++, 1 AVX2, 2 AVX-512, 3 AVX-512 with the register kernel for head
/// sizes 64 and 128 (the default; each where the CPU has it).
#[cfg(test)]
pub fn paged_attention_widest(level: u8) {
    // SAFETY: stores a level in an atomic.
    unsafe { regatta_paged_attention_widest(c_int::from(level)) }
}

/// Whether this CPU runs [`panel_linear`] (AVX-512F, or AVX2 with FMA).
#[cfg(test)]
pub fn panel_kernel_available() -> bool {
    panel_kernel_wide().is_some()
}

/// Whether [`panel_linear`] runs its AVX-512 tiles here (`Some(true)`), its AVX2 tiles
/// (`Some(false)`), or not at all (`None`).
pub fn panel_kernel_wide() -> Option<bool> {
    // SAFETY: reads the CPU's feature flags.
    match unsafe { regatta_panel_kernel_level() } {
        2 => Some(true),
        1 => Some(false),
        _ => None,
    }
}

/// Makes [`panel_linear`] take its AVX2 tiles even where the CPU has AVX-512F (tests:
/// both must give the same bits). Process-wide.
#[cfg(test)]
pub fn panel_force_avx2(force: bool) {
    // SAFETY: stores a flag the kernel reads.
    unsafe { regatta_panel_force_avx2(c_int::from(force)) }
}

/// `input [..., in] · Wᵀ + bias` (`src/shim/panel_linear.cpp`) for a weight `W [out_width,
/// in]` packed in column panels (`packed` `[ceil(out_width / 32), in, 32]`, contiguous;
/// `crate::packed` makes them); float32 on the CPU. An error on a CPU with neither
/// AVX-512F nor AVX2 and FMA, or for shapes that do not fit.
pub fn panel_linear(
    input: &Tensor,
    packed: &Tensor,
    out_width: i64,
    bias: Option<&Tensor>,
) -> Result<Tensor, TchError> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let mut error = [0 as c_char; 1024];
    // SAFETY: live tensor handles (a null bias means none) and valid out-pointers; the
    // shim checks every shape it reads and catches C++ exceptions.
    let status = unsafe {
        regatta_panel_linear(
            input.as_ptr(),
            packed.as_ptr(),
            out_width,
            bias.map_or(std::ptr::null(), Tensor::as_ptr),
            &mut out,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    tensor_answer(status, out, &error)
}

/// RMSNorm of `x` (`[..., width]`) with `weight` (`[width]`), after adding `residual` where
/// given (`src/shim/rms_norm.cpp`): `(sum, sum * rsqrt(mean(sum²) + eps) * weight)`, the sum
/// being `x + residual` (`None` without one). One pass per row where libtorch's `rms_norm`
/// runs six ops. Float32, contiguous, on the CPU, no autograd; an error otherwise.
pub fn rms_norm(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: &Tensor,
    eps: f64,
) -> Result<(Option<Tensor>, Tensor), TchError> {
    let mut sum: *mut C_tensor = std::ptr::null_mut();
    let mut normed: *mut C_tensor = std::ptr::null_mut();
    let mut error = [0 as c_char; 1024];
    // SAFETY: live tensor handles (a null residual means none) and valid out-pointers; the
    // shim checks every shape it reads and catches C++ exceptions.
    let status = unsafe {
        regatta_rms_norm(
            x.as_ptr(),
            residual.map_or(std::ptr::null(), Tensor::as_ptr),
            weight.as_ptr(),
            eps,
            &mut sum,
            &mut normed,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    let normed = tensor_answer(status, normed, &error)?;
    // SAFETY: with a residual the shim wrote a fresh heap at::Tensor for us to own.
    let sum = (!sum.is_null()).then(|| unsafe { Tensor::from_ptr(sum) });
    Ok((sum, normed))
}

/// Attention of `query` `[rows, heads, time, dim]` against the paged KV cache `key_cache` /
/// `value_cache` (`[slots, kv_heads, dim]`), reading keys and values in their slots
/// (`src/shim/paged_attention.cpp`): row `r`'s key `j` lies in slot `read[r, j]`
/// (`[rows, keys]`), the query at `positions[r, t]` sees keys `0..=position` below
/// `lengths[r]`, and with a `window` only the last `window` of them. Float32 on the CPU,
/// int64 indices; GQA as `transformers`' `repeat_kv`. A query that sees no key gets zeros.
/// An error for other devices, kinds or shapes, or a slot outside the cache.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    query: &Tensor,
    key_cache: &Tensor,
    value_cache: &Tensor,
    read: &Tensor,
    lengths: &Tensor,
    positions: &Tensor,
    window: Option<i64>,
    scale: f64,
) -> Result<Tensor, TchError> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let mut error = [0 as c_char; 1024];
    // SAFETY: live tensor handles and valid out-pointers; the shim checks shapes, kinds and
    // every slot it reads, and catches C++ exceptions.
    let status = unsafe {
        regatta_paged_attention(
            query.as_ptr(),
            key_cache.as_ptr(),
            value_cache.as_ptr(),
            read.as_ptr(),
            lengths.as_ptr(),
            positions.as_ptr(),
            window.unwrap_or(0),
            scale,
            &mut out,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    tensor_answer(status, out, &error)
}

/// One decoder layer's attention from its projections, for
/// [`rope_paged_attention`]: the queries, keys and values as the projections give them
/// (`[rows, time, heads * dim]`, keys and values `[rows, time, kv_heads * dim]`), the
/// rotary `cos`/`sin` (`[rows, 1, time, dim]`, contiguous), and the step's cache slots as
/// [`paged_attention`] takes them plus `write` (`[rows * time]`), where the new keys and
/// values go. With `offsets` (`[rows + 1]`) the tokens are packed rather than padded: the
/// projections `[1, tokens, width]`, `cos`/`sin` `[1, 1, tokens, dim]`, `write` and
/// `positions` `[tokens]`, row `r`'s tokens `offsets[r]..offsets[r + 1]`; the output is
/// then `[1, heads, tokens, dim]`.
pub struct PagedLayer<'a> {
    pub query: &'a Tensor,
    pub key: &'a Tensor,
    pub value: &'a Tensor,
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub key_cache: &'a Tensor,
    pub value_cache: &'a Tensor,
    pub write: &'a Tensor,
    pub read: &'a Tensor,
    pub lengths: &'a Tensor,
    pub positions: &'a Tensor,
    pub offsets: Option<&'a Tensor>,
    pub window: Option<i64>,
    pub scale: f64,
}

/// Rotates a layer's queries and keys (`transformers`' `apply_rotary_pos_emb`, rounded as
/// libtorch's ops round it), stores the keys and values in their cache slots and attends as
/// [`paged_attention`] does, in one call (`src/shim/paged_attention.cpp`). Returns the
/// output `[rows, heads, time, dim]`; an error (nothing stored) for other devices, kinds or
/// shapes, or a slot outside the cache.
pub fn rope_paged_attention(layer: &PagedLayer) -> Result<Tensor, TchError> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let mut error = [0 as c_char; 1024];
    // SAFETY: live tensor handles and valid out-pointers; the shim checks shapes, kinds and
    // every slot it reads or writes before writing any, and catches C++ exceptions. The
    // caches are written in place, as `index_copy_` would.
    let status = unsafe {
        regatta_rope_paged_attention(
            layer.query.as_ptr(),
            layer.key.as_ptr(),
            layer.value.as_ptr(),
            layer.cos.as_ptr(),
            layer.sin.as_ptr(),
            layer.key_cache.as_ptr(),
            layer.value_cache.as_ptr(),
            layer.write.as_ptr(),
            layer.read.as_ptr(),
            layer.lengths.as_ptr(),
            layer.positions.as_ptr(),
            layer.offsets.map_or(std::ptr::null(), Tensor::as_ptr),
            layer.window.unwrap_or(0),
            layer.scale,
            &mut out,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    tensor_answer(status, out, &error)
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

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn le_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn a_fresh_buffer_becomes_the_tensor_others_are_copied_and_wrong_lengths_refused() {
        let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        let want = Tensor::from_slice(&values).view([2, 3, 4]);

        // A fresh read: the tensor lies in the buffer itself, and is writable.
        let fresh = Bytes::from(le_bytes(&values));
        let address = fresh.as_ptr() as usize;
        let mut tensor = tensor_from_bytes(fresh, &[2, 3, 4], Kind::Float).unwrap();
        assert_eq!(tensor.data_ptr() as usize, address, "no copy");
        assert!(tensor.equal(&want));
        let _ = tensor.g_mul_scalar_(2.0);
        assert!(tensor.equal(&(&want * 2.0)));
        drop(tensor);

        // Bytes someone else still holds: copied, theirs left as they were.
        let shared = Bytes::from(le_bytes(&values));
        let kept = shared.clone();
        let mut tensor = tensor_from_bytes(shared, &[2, 3, 4], Kind::Float).unwrap();
        assert_ne!(tensor.data_ptr() as usize, kept.as_ptr() as usize);
        let _ = tensor.g_mul_scalar_(2.0);
        assert_eq!(kept.as_ref(), le_bytes(&values).as_slice());

        // Off the element alignment: copied, same values.
        let mut padded = vec![0u8];
        padded.extend(le_bytes(&values));
        let odd = Bytes::from(padded).slice(1..);
        let tensor = tensor_from_bytes(odd, &[24], Kind::Float).unwrap();
        assert!(tensor.equal(&want.view([24])));

        // Other kinds and an empty tensor.
        let ints = tensor_from_bytes(Bytes::from(7i64.to_le_bytes().repeat(3)), &[3], Kind::Int64).unwrap();
        assert_eq!(Vec::<i64>::try_from(&ints).unwrap(), vec![7, 7, 7]);
        assert_eq!(
            tensor_from_bytes(Bytes::new(), &[0, 5], Kind::Float).unwrap().size(),
            vec![0, 5]
        );

        for (bytes, shape) in [
            (le_bytes(&values[..23]), vec![2i64, 3, 4]),
            (le_bytes(&values), vec![-1, 24]),
        ] {
            let error = tensor_from_bytes(Bytes::from(bytes), &shape, Kind::Float).unwrap_err();
            assert!(error.to_string().contains("do not hold"), "{error}");
        }
    }

    /// libtorch's own ops for what `rms_norm` fuses, as `transformers`' LlamaRMSNorm
    /// writes them.
    fn reference_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
        let variance = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        weight * (x * (variance + eps).rsqrt())
    }

    #[test]
    fn rms_norm_with_and_without_a_residual_equals_libtorchs_ops() {
        let cpu = (Kind::Float, Device::Cpu);
        for (shape, width) in [
            (vec![1, 1, 576], 576),
            (vec![3, 5, 7], 7),
            (vec![64, 1, 576], 576),
            (vec![2, 13], 13),
        ] {
            let x = Tensor::randn(shape.as_slice(), cpu) * 3.0;
            let residual = Tensor::randn(shape.as_slice(), cpu);
            let weight = Tensor::randn([width], cpu);
            let (sum, normed) = rms_norm(&x, None, &weight, 1e-5).unwrap();
            assert!(sum.is_none());
            let expected = reference_norm(&x, &weight, 1e-5);
            let tolerance = 1e-6 * f64::try_from(expected.abs().max()).unwrap();
            let diff = f64::try_from((&normed - &expected).abs().max()).unwrap();
            assert!(diff <= tolerance, "{shape:?}: {diff} > {tolerance}");
            let (sum, normed) = rms_norm(&x, Some(&residual), &weight, 1e-5).unwrap();
            let sum = sum.expect("a residual gives the sum back");
            assert!(
                sum.equal(&(&x + &residual)),
                "{shape:?}: the sum is libtorch's add bit for bit"
            );
            let expected = reference_norm(&(&x + &residual), &weight, 1e-5);
            let diff = f64::try_from((&normed - &expected).abs().max()).unwrap();
            assert!(diff <= tolerance, "{shape:?} with a residual: {diff} > {tolerance}");
        }
        // eps matters where a row is all zeros: 0 * rsqrt(eps) = 0, not NaN.
        let zeros = Tensor::zeros([2, 8], cpu);
        let (_, normed) = rms_norm(&zeros, None, &Tensor::ones([8], cpu), 1e-6).unwrap();
        assert!(normed.equal(&zeros));
    }

    #[test]
    fn rms_norm_refuses_what_does_not_fit() {
        let cpu = (Kind::Float, Device::Cpu);
        let x = Tensor::randn([4, 8], cpu);
        let weight = Tensor::ones([8], cpu);
        for (input, residual, weight, why) in [
            (x.to_kind(Kind::Double), None, weight.shallow_clone(), "float64 input"),
            (x.transpose(0, 1), None, Tensor::ones([4], cpu), "non-contiguous input"),
            (x.shallow_clone(), None, Tensor::ones([7], cpu), "weight width"),
            (
                x.shallow_clone(),
                Some(Tensor::ones([4, 7], cpu)),
                weight.shallow_clone(),
                "residual shape",
            ),
            (Tensor::zeros([4, 0], cpu), None, Tensor::ones([0], cpu), "no width"),
        ] {
            assert!(rms_norm(&input, residual.as_ref(), &weight, 1e-5).is_err(), "{why}");
        }
    }

    #[test]
    fn cuda_memory_without_a_cuda_device_is_an_error_not_a_crash() {
        let error = cuda_memory(0, false).expect_err("no CUDA allocator serves device 0 here");
        assert!(!error.to_string().is_empty());
    }

    #[test]
    fn the_tf32_switch_and_sdpa_flags_answer() {
        allow_tf32(false);
        let (flash, efficient, math, _) = sdp_enabled();
        assert!(flash && efficient && math, "libtorch's defaults enable these kernels");
    }
}
