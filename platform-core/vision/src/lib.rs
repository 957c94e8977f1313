//! Images for Kiln's data pipeline, as torchvision reads and transforms them.
//!
//! * Decoding: [`decode_image`] (JPEG through libjpeg-turbo, PNG, WebP, BMP,
//!   TIFF, GIF, PGM/PPM), equal to Pillow's `Image.open(path).convert(mode)`
//!   for the [`ColorMode`] asked for, with Pillow's decompression-bomb limit.
//! * Datasets: [`ImageFolder`] (torchvision's class folders, or a list file)
//!   and [`WebDataset`] (`.tar` shards, with [`ShardOrder`] as the loader's
//!   [`EpochOrder`](kiln_data::EpochOrder)), decoded in the loader's workers;
//!   [`OnError`] says whether a corrupt image stops the run or is skipped.
//! * Transforms on image tensors of every dtype: [`Normalize`], [`RandomCrop`]
//!   (zero padding), [`RandomHorizontalFlip`], [`ToFloat`]; torchvision's
//!   whole set (resize, crops, colour jitter, affine warps, AutoAugment, MixUp
//!   and CutMix) and their configuration in [`transforms`].
//!
//! Every transform is a [`kiln_data::Transform`], seeded per sample and
//! epoch, and every dataset a [`kiln_data::Dataset`] (or an iterable one), so
//! the loaders, samplers and exact mid-epoch resumes of `kiln-data` apply.
//!
//! ```no_run
//! use kiln_data::{Compose, DataLoader, PrefetchLoader, TransformedDataset};
//! use kiln_vision::transforms::RandomResizedCrop;
//! use kiln_vision::{ImageFolder, Normalize, RandomHorizontalFlip, ToFloat};
//!
//! let train = ImageFolder::new("data/train")?;
//! let augment = Compose::new()
//!     .then(RandomResizedCrop::new(224, 224))
//!     .then(RandomHorizontalFlip::default())
//!     .then(ToFloat)
//!     .then(Normalize { mean: vec![0.485, 0.456, 0.406], std: vec![0.229, 0.224, 0.225] });
//! let loader = PrefetchLoader::new(TransformedDataset::new(train, augment, 0), 32)?
//!     .shuffle(0)
//!     .num_workers(4);
//! for batch in loader.batches(0) {
//!     let _batch = batch?;
//! }
//! # Ok::<(), kiln_core::Error>(())
//! ```

mod image;
mod tensor_transforms;
pub mod transforms;

pub use image::{
    decode_image, ColorMode, ImageFolder, OnError, ShardOrder, WebDataset, IMG_EXTENSIONS,
    MAX_SHARDS,
};
pub use tensor_transforms::{Normalize, RandomCrop, RandomHorizontalFlip, ToFloat};
