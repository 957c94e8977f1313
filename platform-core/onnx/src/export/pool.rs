//! Pooling: `MaxPool`, `AveragePool` (`count_include_pad=1`), and
//! `AdaptiveAvgPool2d` as `GlobalAveragePool` (output 1x1), an `AveragePool`
//! (sizes divide) or, exactly as PyTorch's windows, `Slice` + `ReduceMean` +
//! `Concat` per output row and column.

use kiln_core::model::Layer;

use super::conv::pads;
use super::graph::attr;
use super::Result;
use super::{wrong_family, Emitter, Value};

/// PyTorch's adaptive pooling window of output cell `i` of `out` over `len`:
/// `[floor(i * len / out), ceil((i + 1) * len / out))`.
pub(crate) fn adaptive_window(i: usize, len: usize, out: usize) -> (usize, usize) {
    let start = i * len / out;
    let end = ((i + 1) * len).div_ceil(out);
    (start, end)
}

impl Emitter<'_> {
    pub(crate) fn pool(&mut self, path: &str, layer: &Layer, x: &Value) -> Result<String> {
        let ints = |v: [usize; 2]| [v[0] as i64, v[1] as i64];
        match layer {
            Layer::MaxPool2d(c) => Ok(self.g.op(
                path,
                "MaxPool",
                &[&x.name],
                vec![
                    attr::ints("kernel_shape", &ints(c.kernel_size)),
                    attr::ints("strides", &ints(c.effective_stride())),
                    attr::ints("pads", &pads(&c.padding)),
                ],
            )),
            Layer::AvgPool2d(c) => Ok(self.g.op(
                path,
                "AveragePool",
                &[&x.name],
                vec![
                    attr::ints("kernel_shape", &ints(c.kernel_size)),
                    attr::ints("strides", &ints(c.effective_stride())),
                    attr::ints("pads", &pads(&c.padding)),
                    attr::int("count_include_pad", 1),
                ],
            )),
            Layer::AdaptiveAvgPool2d { output_size } => self.adaptive(path, *output_size, x),
            _ => Err(wrong_family(path, layer)),
        }
    }

    fn adaptive(&mut self, path: &str, out: [usize; 2], x: &Value) -> Result<String> {
        let (h, w) = (x.shape[2], x.shape[3]);
        if out == [1, 1] {
            return Ok(self.g.op(path, "GlobalAveragePool", &[&x.name], vec![]));
        }
        if h % out[0] == 0 && w % out[1] == 0 {
            let k = [(h / out[0]) as i64, (w / out[1]) as i64];
            return Ok(self.g.op(
                path,
                "AveragePool",
                &[&x.name],
                vec![attr::ints("kernel_shape", &k), attr::ints("strides", &k)],
            ));
        }
        // The windows overlap or differ in size: average each output row's
        // window of rows, then each output column's window of columns (the
        // mean over a rectangle is the mean of its rows' means).
        let mut current = x.name.clone();
        for (axis, len, cells) in [(2i64, h, out[0]), (3, w, out[1])] {
            if len == cells {
                continue;
            }
            let axes = self.g.ints(path, "axes", &[axis])?;
            let mut parts = Vec::with_capacity(cells);
            for i in 0..cells {
                let (start, end) = adaptive_window(i, len, cells);
                let starts = self.g.ints(path, "starts", &[start as i64])?;
                let ends = self.g.ints(path, "ends", &[end as i64])?;
                let slice = self
                    .g
                    .op(path, "Slice", &[&current, &starts, &ends, &axes], vec![]);
                parts.push(self.g.op(
                    path,
                    "ReduceMean",
                    &[&slice, &axes],
                    vec![attr::int("keepdims", 1)],
                ));
            }
            let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
            current = self
                .g
                .op(path, "Concat", &parts, vec![attr::int("axis", axis)]);
        }
        Ok(current)
    }
}

#[cfg(test)]
mod tests {
    use super::adaptive_window;

    #[test]
    fn adaptive_windows_are_pytorchs() {
        // torch.nn.AdaptiveAvgPool2d((3, 2)) on 7x5: rows [0,3) [2,5) [4,7); columns [0,3) [2,5).
        let rows: Vec<_> = (0..3).map(|i| adaptive_window(i, 7, 3)).collect();
        assert_eq!(rows, [(0, 3), (2, 5), (4, 7)]);
        let cols: Vec<_> = (0..2).map(|i| adaptive_window(i, 5, 2)).collect();
        assert_eq!(cols, [(0, 3), (2, 5)]);
        // Dividing sizes give the plain, disjoint windows.
        let even: Vec<_> = (0..4).map(|i| adaptive_window(i, 8, 4)).collect();
        assert_eq!(even, [(0, 2), (2, 4), (4, 6), (6, 8)]);
    }
}
