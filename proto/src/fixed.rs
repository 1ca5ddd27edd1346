//! Fixed-point amounts of resources: a whole unit is [`UNIT`], so a request for half a
//! GPU is exact. Below everything else in the crate (the error texts format amounts too).

/// Fixed-point scale: one whole unit of a resource.
pub const UNIT: u64 = 10_000;

/// Formats a fixed-point amount without trailing zeros (`1`, `0.5`, `0.001`).
pub fn format_fixed(amount: u64) -> String {
    let whole = amount / UNIT;
    let frac = amount % UNIT;
    if frac == 0 {
        return whole.to_string();
    }
    let digits = format!("{frac:04}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}
