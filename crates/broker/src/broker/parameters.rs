//! Runtime parameters in the broker: set and cleared durably (written to the store before the
//! caller answers, as every definition) and announced to the cluster's metadata group.

use super::metadata_ops::MetaOp;
use super::*;
use crate::parameters::{ParameterDef, Parameters, GLOBAL};

/// Why a parameter was not set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParameterError {
    #[error("vhost {0} not found")]
    NoVhost(String),
}

/// A global parameter lives in no vhost.
fn is_global(def: &ParameterDef) -> bool {
    def.component == GLOBAL && def.vhost.is_empty()
}

impl Broker {
    pub fn parameters(&self) -> &Parameters {
        &self.parameters
    }

    /// Sets (or replaces) a runtime parameter; the caller validated its value.
    pub fn set_parameter(&mut self, def: ParameterDef) -> Result<(), ParameterError> {
        if !is_global(&def) && !self.vhost_exists(&def.vhost) {
            return Err(ParameterError::NoVhost(def.vhost));
        }
        tracing::info!(component = %def.component, vhost = %def.vhost, name = %def.name, "runtime parameter set");
        self.write_def(StoreOp::PutParameter(def.clone()));
        self.announce(MetaOp::PutParameter(def.clone()));
        self.parameters.put(def);
        Ok(())
    }

    /// Clears a runtime parameter; false if there was none of that name.
    pub fn clear_parameter(&mut self, component: &str, vhost: &str, name: &str) -> bool {
        if self.parameters.remove(component, vhost, name).is_none() {
            return false;
        }
        tracing::info!(component, vhost, name, "runtime parameter cleared");
        self.write_def(StoreOp::DeleteParameter {
            component: component.to_owned(),
            vhost: vhost.to_owned(),
            name: name.to_owned(),
        });
        self.announce(MetaOp::DeleteParameter {
            component: component.to_owned(),
            vhost: vhost.to_owned(),
            name: name.to_owned(),
        });
        true
    }

    /// A deleted vhost's parameters go too, on disk as well (the metadata group's entry for
    /// the vhost deletion does the same on every node).
    pub(super) fn forget_parameters(&mut self, vhost: &str) {
        for p in self.parameters.forget_vhost(vhost) {
            self.write_def(StoreOp::DeleteParameter {
                component: p.component,
                vhost: p.vhost,
                name: p.name,
            });
        }
    }

    /// Recovery: a stored parameter comes back (written nowhere).
    pub(super) fn restore_parameter(&mut self, def: &ParameterDef) -> Result<(), AmqpError> {
        if !is_global(def) && !self.vhost_exists(&def.vhost) {
            return Err(AmqpError::not_found(format!(
                "vhost {} not found",
                def.vhost
            )));
        }
        self.parameters.put(def.clone());
        Ok(())
    }
}
