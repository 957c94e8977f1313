//! Images: decoding JPEG, PNG, WebP, BMP, TIFF, GIF, PGM and PPM ([`decode_image`]), class folders
//! ([`ImageFolder`]) and WebDataset tar shards ([`WebDataset`]).

mod decode;
mod folder;
mod formats;
mod pixels;
mod webdataset;

pub use decode::{decode_image, ColorMode};
pub use folder::{ImageFolder, OnError, IMG_EXTENSIONS};
pub use webdataset::{ShardOrder, WebDataset, MAX_SHARDS};
