//! One `section.key=VALUE` given on a command line (`join --set`, `bench scaling --set`),
//! applied to a config file's text before it is parsed, so a setting given so is checked
//! exactly as the same line in the file would be.

use std::str::FromStr;

/// A `section.key=VALUE` setting: VALUE in TOML, a bare word taken as a string.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    /// The config section (`sync`).
    pub section: String,
    /// The key in it (`mode`).
    pub key: String,
    /// The value, as TOML.
    pub value: toml::Value,
}

impl FromStr for Setting {
    type Err = String;

    fn from_str(s: &str) -> Result<Setting, String> {
        let expected = || format!("{s:?}: expected section.key=VALUE");
        let (path, value) = s.split_once('=').ok_or_else(expected)?;
        let (section, key) = path.trim().split_once('.').ok_or_else(expected)?;
        let (section, key) = (section.trim(), key.trim());
        if section.is_empty() || key.is_empty() || key.contains('.') {
            return Err(expected());
        }
        let value = value.trim();
        let value = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.to_string()));
        Ok(Setting {
            section: section.to_string(),
            key: key.to_string(),
            value,
        })
    }
}

/// `text` (a config file's TOML) with `settings` written into it, later ones winning; the
/// text itself when there are none, so a file's error lines keep their numbers.
pub fn apply_settings(text: &str, settings: &[Setting]) -> Result<String, String> {
    if settings.is_empty() {
        return Ok(text.to_string());
    }
    let mut table: toml::Table =
        toml::from_str(text).map_err(|e| e.message().replace('\n', " "))?;
    for s in settings {
        let section = table
            .entry(s.section.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let Some(section) = section.as_table_mut() else {
            return Err(format!(
                "--set {}.{}: {} is not a section",
                s.section, s.key, s.section
            ));
        };
        section.insert(s.key.clone(), s.value.clone());
    }
    toml::to_string(&table).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setting_reads_toml_values_and_bare_words() {
        let s: Setting = "sync.inner_steps=25".parse().expect("setting");
        assert_eq!(
            (s.section.as_str(), s.key.as_str()),
            ("sync", "inner_steps")
        );
        assert_eq!(s.value, toml::Value::Integer(25));
        let s: Setting = "sync.mode = diloco".parse().expect("setting");
        assert_eq!(s.value, toml::Value::String("diloco".into()));
        let s: Setting = r#"sync.outer_values="int8""#.parse().expect("setting");
        assert_eq!(s.value, toml::Value::String("int8".into()));
        for bad in ["sync", "sync=1", ".mode=1", "sync.=1", "a.b.c=1"] {
            assert!(bad.parse::<Setting>().is_err(), "{bad}");
        }
    }

    #[test]
    fn settings_replace_or_add_keys_and_sections() {
        let text = "[train]\nbatch_size = 32\n";
        let settings: Vec<Setting> = [
            "train.batch_size=64",
            "sync.mode=diloco",
            "train.batch_size=16",
        ]
        .iter()
        .map(|s| s.parse().expect("setting"))
        .collect();
        let written: toml::Table =
            toml::from_str(&apply_settings(text, &settings).expect("applied")).expect("toml");
        assert_eq!(written["train"]["batch_size"].as_integer(), Some(16));
        assert_eq!(written["sync"]["mode"].as_str(), Some("diloco"));
        assert_eq!(apply_settings(text, &[]).expect("as is"), text);
        let not_a_section: Setting = "train.x=1".parse().expect("setting");
        assert!(apply_settings("train = 3\n", &[not_a_section]).is_err());
    }
}
