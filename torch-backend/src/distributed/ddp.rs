//! placeholder
/// DDP.
pub struct DistributedDataParallel;
