//! The backends: their identity, health (Pingora's active HTTP checks), in-flight accounting,
//! outlier ejection and engine telemetry, and the [`Generation`] (config + fleet) published as
//! one on reload.

pub mod adapters;
mod backend;
mod charge;
pub mod direct;
mod error;
mod generation;
mod health;
pub mod in_flight;
pub mod kv_events;
pub(crate) mod learn;
mod load;
mod metrics;
pub mod models;
pub(crate) mod outlier;
pub mod read_ahead;
mod roster;
mod router_wait;
mod scrape;
pub(crate) mod telemetry;
pub mod transfer;
mod turns;
mod upstream;

pub use charge::InflightGuard;
pub use error::FleetError;
pub use generation::{Current, Generation};
pub use metrics::FleetMetrics;
pub use roster::Fleet;
pub use scrape::scrape_forever;
