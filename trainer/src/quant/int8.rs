//! LLM.int8's weight layout as bitsandbytes 0.50 makes it (`int8_vectorwise_quant` with
//! threshold 0, what `Int8Params` does to a weight): one signed byte per element, row by
//! row, each row scaled by its largest magnitude. In f32, as its default kernel computes:
//! `code = round_half_even(x * ((1 / absmax) * 127))` and back `(code * absmax) * (1/127)`,
//! with `1/127` the f32 nearest 7.874015718698502e-3. A row of zeros has absmax 0 and
//! codes 0 (bitsandbytes gets 0 from casting NaN to int8 on x86; here it is explicit).

use super::QuantError;

/// bitsandbytes' `1 / 127`, as f32.
const INVERSE_127: f32 = 7.874015718698502e-3_f64 as f32;

/// A 2-D weight in 8 bits, row by row.
#[derive(Clone, Debug, PartialEq)]
pub struct Int8Rows {
    /// Elements per row.
    pub cols: usize,
    /// One code per element, in order.
    pub codes: Vec<i8>,
    /// Each row's largest magnitude (bitsandbytes' `SCB`).
    pub scales: Vec<f32>,
}

impl Int8Rows {
    /// Bytes held: the codes and the row scales.
    pub fn bytes(&self) -> usize {
        self.codes.len() + self.scales.len() * 4
    }
}

/// Quantizes `values` (a weight's elements in order, `cols` a row) row by row.
pub fn quantize_int8_rows(values: &[f32], cols: usize) -> Result<Int8Rows, QuantError> {
    if values.is_empty() || cols == 0 {
        return Err(QuantError::Empty);
    }
    if !values.len().is_multiple_of(cols) {
        return Err(QuantError::Ragged {
            len: values.len(),
            cols,
        });
    }
    if let Some(at) = values.iter().position(|v| !v.is_finite()) {
        return Err(QuantError::NotFinite(at));
    }
    let mut codes = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(values.len() / cols);
    for row in values.chunks_exact(cols) {
        let absmax = super::absmax_of(row);
        scales.push(absmax);
        if absmax == 0.0 {
            codes.extend(std::iter::repeat_n(0i8, cols));
            continue;
        }
        let factor = (1.0 / absmax) * 127.0;
        // |x * factor| rounds to at most 127: the cast never saturates.
        codes.extend(row.iter().map(|x| (x * factor).round_ties_even() as i8));
    }
    Ok(Int8Rows { cols, codes, scales })
}

/// The values `q` stands for, as bitsandbytes' `int8_vectorwise_dequant` gives them.
pub fn dequantize_int8_rows(q: &Int8Rows) -> Vec<f32> {
    q.codes
        .chunks_exact(q.cols)
        .zip(&q.scales)
        .flat_map(|(row, scale)| row.iter().map(move |c| (f32::from(*c) * scale) * INVERSE_127))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_scale_by_their_own_absmax_to_127_and_come_back_within_half_a_step() {
        let values = [0.5f32, -1.0, 0.25, 0.0, 0.0, 0.0, 3.0, 1.5, -0.75];
        let q = quantize_int8_rows(&values, 3).unwrap();
        assert_eq!(q.scales, vec![1.0, 0.0, 3.0]);
        // 0.5 * 127 = 63.5 rounds to the even 64; a zero row is all zero codes.
        assert_eq!(q.codes, vec![64, -127, 32, 0, 0, 0, 127, 64, -32]);
        let back = dequantize_int8_rows(&q);
        for (row, (x, y)) in values.iter().zip(&back).enumerate() {
            let step = q.scales[row / 3] / 127.0;
            assert!((x - y).abs() <= step / 2.0 + 1e-7, "{x} vs {y}");
        }
        assert_eq!(q.bytes(), 9 + 3 * 4);
    }

    #[test]
    fn ragged_empty_and_non_finite_weights_are_refused() {
        assert_eq!(
            quantize_int8_rows(&[1.0; 7], 3),
            Err(QuantError::Ragged { len: 7, cols: 3 })
        );
        assert_eq!(quantize_int8_rows(&[], 3), Err(QuantError::Empty));
        assert_eq!(
            quantize_int8_rows(&[1.0, f32::NAN, 0.0], 3),
            Err(QuantError::NotFinite(1))
        );
    }
}
