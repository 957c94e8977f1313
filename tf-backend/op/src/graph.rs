//! Adding a registered op's node to a TensorFlow graph.

use kiln_core::{DType, Error, Result};
use kiln_custom_op::{AttrValue, Attrs, CustomOp};
use tensorflow::{DataType, Graph, Operation, Output, Status};

use crate::registry::is_registered;

/// Adds a node of `O` named `name` to `graph`, fed by `inputs` (one per schema
/// input, in order, all float32 or all float64: the kernel's `T`), with the
/// attribute values `attrs` (start from [`Attrs::defaults`] of `O`'s schema),
/// and returns its outputs in schema order. `O` must be [registered](crate::register).
///
/// # Errors
///
/// [`Error::InvalidArgument`] when `O` is not registered, the number of inputs
/// is wrong or `attrs` names an attribute `O` does not have (or with another
/// type); [`Error::DTypeMismatch`] naming the input when an input is not
/// float32 or float64 or differs from the first; [`Error::Backend`] with
/// TensorFlow's status when it refuses the node, which includes an error of
/// `O`'s shape function on the inputs' static shapes (its message is the
/// status's).
pub fn add_op<O: CustomOp>(
    graph: &mut Graph,
    name: &str,
    inputs: &[Output],
    attrs: &Attrs,
) -> Result<Vec<Output>> {
    let schema = O::schema();
    let op = schema.qualified_name();
    let op_type = schema.tf_op_name();
    if !is_registered::<O>() {
        return Err(Error::invalid_argument(
            op,
            "the op is not registered with TensorFlow: call kiln_tf_op::register first",
        ));
    }
    if inputs.len() != schema.inputs.len() {
        return Err(Error::invalid_argument(
            op,
            format!(
                "node `{name}` got {} inputs, the op takes {} ({})",
                inputs.len(),
                schema.inputs.len(),
                schema.inputs.join(", ")
            ),
        ));
    }
    check_dtypes(&op, &schema.inputs, inputs)?;
    for (attr, value) in attrs.iter() {
        let expected = schema.attrs.iter().find(|a| a.name == attr);
        if expected.map(|a| a.default.kind()) != Some(value.kind()) {
            let have: Vec<String> = schema
                .attrs
                .iter()
                .map(|a| format!("{}: {}", a.name, a.default.kind().name()))
                .collect();
            return Err(Error::invalid_argument(
                format!("{op}.{attr}"),
                format!(
                    "a {} attribute the op does not have; it has [{}]",
                    value.kind().name(),
                    have.join(", ")
                ),
            ));
        }
    }
    let build = |graph: &mut Graph| -> std::result::Result<Operation, Status> {
        let mut node = graph.new_operation(&op_type, name)?;
        for input in inputs {
            node.add_input(input.clone());
        }
        for (attr, value) in attrs.iter() {
            match value {
                // TensorFlow float attributes are f32.
                AttrValue::Float(v) => node.set_attr_float(attr, v as f32)?,
                AttrValue::Int(v) => node.set_attr_int(attr, v)?,
                AttrValue::Bool(v) => node.set_attr_bool(attr, v)?,
            }
        }
        node.finish()
    };
    let operation = build(graph).map_err(|s| {
        kiln_tf::tf_error(
            &format!("adding {op} (TensorFlow op {op_type}) as node `{name}`"),
            s,
        )
    })?;
    Ok((0..schema.outputs.len())
        .map(|index| Output {
            operation: operation.clone(),
            index: index as i32,
        })
        .collect())
}

/// Every input float32 or float64, all alike.
fn check_dtypes(op: &str, names: &[String], inputs: &[Output]) -> Result<()> {
    let mut first: Option<DataType> = None;
    for (input, name) in inputs.iter().zip(names) {
        let dtype = input.operation.output_type(input.index as usize);
        let expected = match first {
            None if matches!(dtype, DataType::Float | DataType::Double) => {
                first = Some(dtype);
                continue;
            }
            None => DataType::Float,
            Some(f) if f == dtype => continue,
            Some(f) => f,
        };
        let context = format!("{op} input `{name}` (float32 or float64, all inputs alike)");
        return Err(match kiln_dtype(dtype) {
            Some(actual) => Error::DTypeMismatch {
                context,
                expected: kiln_dtype(expected).unwrap_or(DType::F32),
                actual,
            },
            None => Error::invalid_argument(context, format!("got TensorFlow data type {dtype}")),
        });
    }
    Ok(())
}

fn kiln_dtype(dtype: DataType) -> Option<DType> {
    Some(match dtype {
        DataType::Float => DType::F32,
        DataType::Double => DType::F64,
        DataType::Int32 => DType::I32,
        DataType::Int64 => DType::I64,
        DataType::UInt8 => DType::U8,
        DataType::BFloat16 => DType::BF16,
        DataType::Half => DType::F16,
        _ => return None,
    })
}
