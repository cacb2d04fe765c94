//! Training data of the general-graph trainer: synthetic (the default), an image set in the
//! `parallax-images/1` format (`scripts/make_shapes.py` writes one), or a text file read as
//! bytes for a byte-level language model.

use std::sync::Arc;

/// Magic bytes of an image set.
pub const IMAGES_MAGIC: &[u8; 8] = b"PXIMG1\n\0";

/// A labelled image set held in memory: `count` images of `channels × height × width` u8
/// pixels (CHW) with a class each.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageSet {
    pub count: usize,
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub classes: u64,
    pub labels: Vec<u8>,
    pub pixels: Vec<u8>,
}

impl ImageSet {
    /// Parses `parallax-images/1`: the magic, five little-endian u32 (count, channels,
    /// height, width, classes), then per image a u8 label and its pixels. Errors name the
    /// field that is wrong.
    pub fn parse(bytes: &[u8]) -> Result<ImageSet, String> {
        if bytes.len() < 28 || &bytes[..8] != IMAGES_MAGIC {
            return Err("not a parallax-images/1 file (it starts with PXIMG1; scripts/make_shapes.py writes one)".into());
        }
        let u = |i: usize| u32::from_le_bytes(bytes[8 + 4 * i..12 + 4 * i].try_into().unwrap());
        let (count, channels, height, width, classes) = (u(0), u(1), u(2), u(3), u(4));
        for (name, v) in [
            ("count", count),
            ("channels", channels),
            ("height", height),
            ("width", width),
            ("classes", classes),
        ] {
            if v == 0 {
                return Err(format!("header field {name} is 0"));
            }
        }
        if classes > 256 {
            return Err(format!(
                "header field classes is {classes}; labels are one byte"
            ));
        }
        let image = u64::from(channels) * u64::from(height) * u64::from(width);
        let need = 28 + u64::from(count) * (1 + image);
        if bytes.len() as u64 != need {
            return Err(format!(
                "{} bytes, but its header ({count} images of {channels}×{height}×{width}) needs {need}",
                bytes.len()
            ));
        }
        let image = image as usize;
        let mut labels = Vec::with_capacity(count as usize);
        let mut pixels = Vec::with_capacity(count as usize * image);
        for rec in bytes[28..].chunks_exact(1 + image) {
            if u32::from(rec[0]) >= classes {
                return Err(format!(
                    "image {}: label {} is not below classes = {classes}",
                    labels.len(),
                    rec[0]
                ));
            }
            labels.push(rec[0]);
            pixels.extend_from_slice(&rec[1..]);
        }
        Ok(ImageSet {
            count: count as usize,
            channels: channels as usize,
            height: height as usize,
            width: width as usize,
            classes: u64::from(classes),
            labels,
            pixels,
        })
    }

    /// Pixel `(c, y, x)` of image `i`, normalised to about [-2, 2].
    pub fn pixel(&self, i: usize, c: usize, y: usize, x: usize) -> f32 {
        let at = ((i * self.channels + c) * self.height + y) * self.width + x;
        (f32::from(self.pixels[at]) / 255.0 - 0.5) / 0.25
    }
}

/// Where a general-graph run's inputs come from.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum GraphData {
    /// Class-patterned images, class labels and token progressions made up from the seed.
    #[default]
    Synthetic,
    /// Images and their classes; sample `s` of the run is image `s mod count`.
    Images(Arc<ImageSet>),
    /// Text read as bytes (tokens 0–255): sample `s` is the window at a seeded offset.
    Text(Arc<Vec<u8>>),
}
