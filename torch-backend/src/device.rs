//! Kiln devices as libtorch devices.

use kiln_core::{Device, Error, Result};

/// The libtorch device for a Kiln device, checked to exist.
///
/// A CUDA device that is not present is [`Error::DeviceUnavailable`], saying how
/// many devices there are, rather than a libtorch exception at first use.
pub fn device_to_tch(device: Device) -> Result<tch::Device> {
    match device {
        Device::Cpu => Ok(tch::Device::Cpu),
        Device::Cuda(index) => {
            let count = cuda_device_count();
            if index >= count {
                return Err(Error::DeviceUnavailable {
                    device,
                    reason: if count == 0 {
                        "libtorch sees no CUDA device on this machine".to_owned()
                    } else {
                        format!(
                            "libtorch sees {count} CUDA device(s), cuda:0 to cuda:{}",
                            count - 1
                        )
                    },
                });
            }
            Ok(tch::Device::Cuda(index))
        }
    }
}

/// The Kiln device of a libtorch device; devices Kiln does not model are `Unsupported`.
pub fn device_from_tch(device: tch::Device) -> Result<Device> {
    match device {
        tch::Device::Cpu => Ok(Device::Cpu),
        tch::Device::Cuda(index) => Ok(Device::Cuda(index)),
        other => Err(Error::unsupported(format!("libtorch device {other:?}"))),
    }
}

/// Whether libtorch can use a CUDA device (false when `libtorch_cuda` is not
/// loaded or no driver or device is present).
pub fn cuda_is_available() -> bool {
    tch::Cuda::is_available()
}

/// The number of CUDA devices libtorch sees.
pub fn cuda_device_count() -> usize {
    usize::try_from(tch::Cuda::device_count()).unwrap_or(0)
}
