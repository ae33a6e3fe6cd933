//! `kvroute.log`: the access log's format.

use serde::Deserialize;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// One line per request through `log` (target `kvroute::access`), as before.
    #[default]
    Text,
    /// One JSON object per request on stderr, written by a thread of its own.
    Json,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub format: LogFormat,
}
