//! `[data]` read from its table: the source `dataset` names, then each key
//! in the part of the section that takes it, the parts' keys read from
//! serde's derive rather than listed by hand.

use serde::Deserialize;

use super::{
    CsvSource, DataConfig, DataSource, DatasetKind, FileSource, ImageFolderSource, ImageKeys,
    LoaderKeys, NpySource, ShardSource, TabularKeys, TextSource,
};

/// The field names serde's derive gives `deserialize_struct` for `T`: the
/// keys a section's part takes, read from the type rather than listed by hand.
fn fields_of<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
    /// A deserializer that only records the fields a struct asks for.
    struct Probe<'a>(&'a mut &'static [&'static str]);
    #[derive(Debug)]
    struct Stop;
    impl std::fmt::Display for Stop {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("probed")
        }
    }
    impl std::error::Error for Stop {}
    impl serde::de::Error for Stop {
        fn custom<T: std::fmt::Display>(_: T) -> Self {
            Stop
        }
    }
    impl<'de> serde::Deserializer<'de> for Probe<'_> {
        type Error = Stop;
        fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
            Err(Stop)
        }
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> Result<V::Value, Stop> {
            *self.0 = fields;
            Err(Stop)
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Probe(&mut fields));
    fields
}

/// The keys of each part of `[data]` for `kind`: its source's, the image or
/// tabular keys where it takes them, and the loader's.
fn parts_of(kind: DatasetKind) -> [&'static [&'static str]; 3] {
    let source = match kind {
        DatasetKind::Digits | DatasetKind::Mnist => fields_of::<FileSource>(),
        DatasetKind::Csv => fields_of::<CsvSource>(),
        DatasetKind::Npy => fields_of::<NpySource>(),
        DatasetKind::ImageFolder => fields_of::<ImageFolderSource>(),
        DatasetKind::Webdataset => fields_of::<ShardSource>(),
        DatasetKind::Text => fields_of::<TextSource>(),
    };
    let shaping = if kind.is_images() {
        fields_of::<ImageKeys>()
    } else if kind.is_tabular() {
        fields_of::<TabularKeys>()
    } else {
        &[]
    };
    [source, shaping, fields_of::<LoaderKeys>()]
}

/// A part of `[data]`: the keys of `table` that `T` takes, as `T`.
fn take_part<T: serde::de::DeserializeOwned>(
    table: &toml::Table,
) -> std::result::Result<T, String> {
    let fields = fields_of::<T>();
    let part: toml::Table = table
        .iter()
        .filter(|(k, _)| fields.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    toml::Value::Table(part)
        .try_into()
        .map_err(|e: toml::de::Error| e.message().to_owned())
}

impl DataConfig {
    /// `[data]` from its table: the source `dataset` names, then each key in
    /// the part that takes it; a key of another source is refused, naming the
    /// sources it applies to.
    fn from_table(mut table: toml::Table) -> std::result::Result<Self, String> {
        let kind: DatasetKind = table
            .remove("dataset")
            .ok_or("missing field `dataset`")?
            .try_into()
            .map_err(|e: toml::de::Error| e.message().to_owned())?;
        let parts = parts_of(kind);
        if let Some(key) = table
            .keys()
            .find(|k| !parts.iter().any(|p| p.contains(&k.as_str())))
        {
            let takers: Vec<&str> = DatasetKind::ALL
                .into_iter()
                .filter(|&other| parts_of(other).iter().any(|p| p.contains(&key.as_str())))
                .map(DatasetKind::name)
                .collect();
            if kind == DatasetKind::Webdataset && key == "path" {
                return Err(
                    "a webdataset is read from `shards` (and `val_shards`), not `path`".into(),
                );
            }
            return Err(match takers.split_last() {
                None => format!(
                    "unknown field `{key}`, expected one of {}",
                    parts
                        .iter()
                        .flat_map(|p| p.iter())
                        .map(|k| format!("`{k}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                Some((last, [])) => {
                    format!("applies to {last} data, not dataset = \"{}\"", kind.name())
                }
                Some((last, rest)) => format!(
                    "applies to {} and {last} data, not dataset = \"{}\"",
                    rest.join(", "),
                    kind.name()
                ),
            });
        }
        let source = match kind {
            DatasetKind::Digits => DataSource::Digits(take_part(&table)?),
            DatasetKind::Mnist => DataSource::Mnist(take_part(&table)?),
            DatasetKind::Csv => DataSource::Csv(take_part(&table)?),
            DatasetKind::Npy => DataSource::Npy(take_part(&table)?),
            DatasetKind::ImageFolder => DataSource::ImageFolder(take_part(&table)?),
            DatasetKind::Webdataset => DataSource::Webdataset(take_part(&table)?),
            DatasetKind::Text => DataSource::Text(Box::new(take_part(&table)?)),
        };
        Ok(Self {
            source,
            images: kind.is_images().then(|| take_part(&table)).transpose()?,
            tabular: kind.is_tabular().then(|| take_part(&table)).transpose()?,
            loader: take_part(&table)?,
        })
    }
}

impl<'de> Deserialize<'de> for DataConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let table = toml::Table::deserialize(d)?;
        Self::from_table(table).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::super::ImageSize;
    use super::*;

    fn parse(text: &str) -> std::result::Result<DataConfig, String> {
        let table: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
        DataConfig::from_table(table)
    }

    #[test]
    fn the_parts_read_their_keys_from_their_types() {
        assert_eq!(fields_of::<FileSource>(), ["path"]);
        assert!(fields_of::<ShardSource>().contains(&"label_key"));
        assert!(fields_of::<LoaderKeys>().contains(&"batch_size"));
        let [source, shaping, loader] = parts_of(DatasetKind::Csv);
        assert_eq!(source, ["path", "label_column", "has_header"]);
        assert_eq!(shaping, ["input_shape", "scale"]);
        assert_eq!(
            loader,
            ["val_fraction", "batch_size", "workers", "drop_last"]
        );
        assert!(parts_of(DatasetKind::Text)[1].is_empty());
    }

    #[test]
    fn a_key_of_another_source_names_the_sources_it_applies_to() {
        let err = parse("dataset = \"digits\"\nlabel_key = \"json\"").unwrap_err();
        assert_eq!(err, "applies to webdataset data, not dataset = \"digits\"");
        let err = parse("dataset = \"digits\"\nlabel_column = \"y\"").unwrap_err();
        assert_eq!(
            err,
            "applies to csv and text data, not dataset = \"digits\""
        );
        let err = parse("dataset = \"text\"\npath = \"a\"\nscale = 2.0").unwrap_err();
        assert_eq!(
            err,
            "applies to digits, mnist, csv and npy data, not dataset = \"text\""
        );
        let err = parse("dataset = \"csv\"\nbatch_sise = 2").unwrap_err();
        assert!(
            err.starts_with("unknown field `batch_sise`, expected one of `path`"),
            "{err}"
        );
        assert_eq!(
            parse("path = \"a\"").unwrap_err(),
            "missing field `dataset`"
        );
    }

    #[test]
    fn each_part_gets_its_keys_and_a_config_round_trips() {
        let config = parse(
            "dataset = \"image_folder\"\npath = \"imgs\"\nimage_size = 8\nbatch_size = 4\n\
             mixup_alpha = 0.2",
        )
        .unwrap();
        let DataSource::ImageFolder(folder) = &config.source else {
            panic!("{config:?}")
        };
        assert_eq!(folder.path.as_deref(), Some(std::path::Path::new("imgs")));
        let images = config.images.as_ref().unwrap();
        assert_eq!(images.image_size, Some(ImageSize::Square(8)));
        assert_eq!(images.mixup_alpha, Some(0.2));
        assert_eq!(config.loader.batch_size, 4);
        assert!(config.tabular.is_none());
        let text = toml::to_string(&config).unwrap();
        assert_eq!(parse(&text).unwrap(), config, "{text}");
        let json = serde_json::to_value(&config).unwrap();
        assert_eq!(json["dataset"], "image_folder");
        assert_eq!(json["image_size"], 8);
        let back: DataConfig = serde_json::from_value(json).unwrap();
        assert_eq!(back, config);
        let digits = parse("dataset = \"digits\"\nscale = 16.0").unwrap();
        assert_eq!(digits.tabular().scale, 16.0);
        assert_eq!(parse("dataset = \"csv\"").unwrap().tabular().scale, 1.0);
    }
}
