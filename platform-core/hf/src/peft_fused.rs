//! LoRA adapters of fused checkpoint modules (Phi-3's `qkv_proj` and
//! `gate_up_proj`, GPT-2's `c_attn`), which Kiln holds as separate
//! projections: a PEFT adapter of the fused module is one `lora_A` and one
//! `lora_B` whose rows follow the parts.
//!
//! - Read: a rank-`r` adapter gives each part the same `lora_A` and its rows
//!   of `lora_B`, which computes exactly what PEFT's adapter does (Kiln then
//!   trains each part's copy of `lora_A` on its own).
//! - Written: Kiln's adapters of `n` parts become one adapter of rank `n r`,
//!   their `lora_A`s stacked and `lora_B` block-diagonal (zero rows for the
//!   parts not adapted), with PEFT's `rank_pattern` and `alpha_pattern`
//!   keeping each part's scale; exact in `PeftModel`, and read back into
//!   Kiln block by block.

use kiln_core::{DType, HostTensor};

/// One part of a fused module: its Kiln projection (`1.0.block.1.q_proj`)
/// and its number of rows (output features).
#[derive(Clone, Debug)]
pub(crate) struct Part {
    pub(crate) module: String,
    pub(crate) rows: usize,
}

/// A LoRA adapter: `lora_A` `[rank, in]` and `lora_B` `[out, rank]`.
pub(crate) type Pair = (HostTensor, HostTensor);

fn floats(t: &HostTensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .as_slice::<f32>()
        .map(<[f32]>::to_vec)
        .unwrap_or_default()
}

/// The adapters of `parts` (`None`: not adapted) as one adapter of the fused
/// module, of rank `parts.len() * r`: part `i`'s `lora_A` in rows block `i`
/// (zeros for a part not adapted) and its `lora_B` in its rows and columns
/// block `i`, zeros elsewhere.
pub(crate) fn fuse(parts: &[(usize, Option<&Pair>)]) -> Result<Pair, String> {
    let Some(first) = parts.iter().find_map(|(_, p)| *p) else {
        return Err("no part is adapted".into());
    };
    let (r, inputs) = match first.0.dims() {
        [r, i] => (*r, *i),
        other => return Err(format!("lora_A has shape {other:?}, expected [rank, in]")),
    };
    let rank = r * parts.len();
    let rows: usize = parts.iter().map(|(n, _)| n).sum();
    let mut a = vec![0f32; rank * inputs];
    let mut b = vec![0f32; rows * rank];
    let mut row = 0;
    for (block, (n, pair)) in parts.iter().enumerate() {
        if let Some((pa, pb)) = pair {
            if pa.dims() != [r, inputs] || pb.dims() != [*n, r] {
                return Err(format!(
                    "a part's adapter has shapes {:?} and {:?}, expected [{r}, {inputs}] and \
                     [{n}, {r}]: one rank for every part",
                    pa.dims(),
                    pb.dims()
                ));
            }
            a[block * r * inputs..(block + 1) * r * inputs].copy_from_slice(&floats(pa));
            let values = floats(pb);
            for i in 0..*n {
                let at = (row + i) * rank + block * r;
                b[at..at + r].copy_from_slice(&values[i * r..(i + 1) * r]);
            }
        }
        row += n;
    }
    Ok((
        HostTensor::new(a, [rank, inputs]).map_err(|e| e.to_string())?,
        HostTensor::new(b, [rows, rank]).map_err(|e| e.to_string())?,
    ))
}

/// One adapter of a fused module, `lora_A` `[rank, in]` and `lora_B`
/// `[rows, rank]`, as adapters of its `parts` (their rows) for Kiln's rank
/// `r`: `rank == r` (PEFT's own) gives every part `lora_A` and its rows of
/// `lora_B`; `rank == parts.len() * r` must be block-diagonal, as [`fuse`]
/// writes it, and gives part `i` block `i`.
pub(crate) fn split(
    a: &HostTensor,
    b: &HostTensor,
    parts: &[usize],
    r: usize,
) -> Result<Vec<Pair>, String> {
    let rows: usize = parts.iter().sum();
    let (rank, inputs) = match a.dims() {
        [rank, inputs] => (*rank, *inputs),
        other => return Err(format!("lora_A has shape {other:?}, expected [rank, in]")),
    };
    if b.dims() != [rows, rank] {
        return Err(format!(
            "lora_B has shape {:?}, expected [{rows}, {rank}] (the fused module's rows, and \
             lora_A's rank)",
            b.dims()
        ));
    }
    let blocks = if rank == r {
        false
    } else if rank == r * parts.len() {
        true
    } else {
        return Err(format!(
            "its rank {rank} is neither the adapter's r = {r} nor {} x {r}, one block per part \
             (as Kiln writes a fused module's adapters)",
            parts.len()
        ));
    };
    let (av, bv) = (floats(a), floats(b));
    let mut out = Vec::with_capacity(parts.len());
    let mut row = 0;
    for (block, &n) in parts.iter().enumerate() {
        let cols = if blocks {
            block * r..(block + 1) * r
        } else {
            0..r
        };
        let mut pb = Vec::with_capacity(n * r);
        for i in 0..n {
            let at = (row + i) * rank;
            let line = &bv[at..at + rank];
            if blocks
                && line
                    .iter()
                    .enumerate()
                    .any(|(j, v)| !cols.contains(&j) && *v != 0.0)
            {
                return Err(format!(
                    "its rank {rank} is {} x r = {r}, but lora_B is not block-diagonal over \
                     the parts (as Kiln writes a fused module's adapters): PEFT's per-module \
                     ranks are read for that layout only",
                    parts.len()
                ));
            }
            pb.extend_from_slice(&line[cols.clone()]);
        }
        let pa = av[cols.start * inputs..cols.end * inputs].to_vec();
        out.push((
            HostTensor::new(pa, [r, inputs]).map_err(|e| e.to_string())?,
            HostTensor::new(pb, [n, r]).map_err(|e| e.to_string())?,
        ));
        row += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(values: &[f32], dims: [usize; 2]) -> HostTensor {
        HostTensor::new(values.to_vec(), dims).unwrap()
    }

    #[test]
    fn fused_adapters_split_back_into_their_parts() {
        // Parts of 2, 1 and 2 rows; the first and last adapted at rank 1.
        let q = (t(&[1.0, 2.0], [1, 2]), t(&[3.0, 4.0], [2, 1]));
        let v = (t(&[5.0, 6.0], [1, 2]), t(&[7.0, 8.0], [2, 1]));
        let (a, b) = fuse(&[(2, Some(&q)), (1, None), (2, Some(&v))]).unwrap();
        assert_eq!(floats(&a), [1.0, 2.0, 0.0, 0.0, 5.0, 6.0]);
        assert_eq!(b.dims(), [5, 3]);
        assert_eq!(
            floats(&b),
            [3.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 7.0, 0.0, 0.0, 8.0]
        );
        let parts = split(&a, &b, &[2, 1, 2], 1).unwrap();
        assert_eq!(floats(&parts[0].0), [1.0, 2.0]);
        assert_eq!(floats(&parts[0].1), [3.0, 4.0]);
        assert_eq!(floats(&parts[1].1), [0.0]);
        assert_eq!(floats(&parts[2].1), [7.0, 8.0]);
        // PEFT's own rank-r adapter: every part shares lora_A.
        let shared = split(
            &t(&[1.0, 1.0], [1, 2]),
            &t(&[1.0; 5], [5, 1]),
            &[2, 1, 2],
            1,
        )
        .unwrap();
        assert!(shared.iter().all(|(a, _)| floats(a) == [1.0, 1.0]));
        // Rank 3 over r = 1 that is not block-diagonal is refused.
        let err = split(&a, &t(&[1.0; 15], [5, 3]), &[2, 1, 2], 1).unwrap_err();
        assert!(err.contains("not block-diagonal"), "{err}");
        let err = split(&a, &t(&[1.0; 10], [5, 2]), &[2, 1, 2], 1).unwrap_err();
        assert!(err.contains("expected [5, 3]"), "{err}");
    }
}
