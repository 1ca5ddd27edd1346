//! ZeRO data parallelism: the partition arithmetic (pure) that stages 1, 2 and 3 share.

pub mod partition;
