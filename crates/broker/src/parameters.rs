//! Runtime parameters, as RabbitMQ's `rabbit_runtime_parameters` keeps them: a JSON value
//! per component, vhost and name (a dynamic shovel is one, component `shovel`). The broker
//! keeps, stores and replicates them; what a component does with its values (validating
//! them, running a shovel) is the server's business. Vhost limits, which RabbitMQ also
//! keeps as parameters, have their own table (`limits`).

use std::collections::BTreeMap;

/// The component of global parameters (RabbitMQ's `/api/global-parameters`, such as the
/// cluster's name): kept beside the others, under no vhost (`""`), and listed only when asked
/// for by name.
pub const GLOBAL: &str = "global";

/// A global parameter, RabbitMQ's: the cluster's name, as `rabbitmqctl set_cluster_name`
/// sets it.
pub const CLUSTER_NAME: &str = "cluster_name";

/// One runtime parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParameterDef {
    pub component: String,
    pub vhost: String,
    pub name: String,
    /// The value as JSON text, as the component's validation accepted it.
    pub value: String,
}

/// Every runtime parameter of the node, by component, vhost and name.
#[derive(Clone, Debug, Default)]
pub struct Parameters {
    map: BTreeMap<(String, String, String), ParameterDef>,
    /// Moves on every change, so that a component's runner can tell cheaply that it has
    /// something to look at.
    generation: u64,
}

impl Parameters {
    pub fn get(&self, component: &str, vhost: &str, name: &str) -> Option<&ParameterDef> {
        self.map
            .get(&(component.to_owned(), vhost.to_owned(), name.to_owned()))
    }

    /// Parameters of one component (every vhost's with `None`, not the global ones), in one
    /// vhost or all, in name order.
    pub fn list<'a>(
        &'a self,
        component: Option<&'a str>,
        vhost: Option<&'a str>,
    ) -> impl Iterator<Item = &'a ParameterDef> + 'a {
        self.map.values().filter(move |p| {
            component.map_or(p.component != GLOBAL, |c| c == p.component)
                && vhost.is_none_or(|v| v == p.vhost)
        })
    }

    /// Every parameter, the global ones included.
    pub fn all(&self) -> impl Iterator<Item = &ParameterDef> {
        self.map.values()
    }

    /// A global parameter's value (its JSON text).
    pub fn global(&self, name: &str) -> Option<&str> {
        self.get(GLOBAL, "", name).map(|p| p.value.as_str())
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Sets a parameter; the one it replaced, if any.
    pub fn put(&mut self, def: ParameterDef) -> Option<ParameterDef> {
        self.generation += 1;
        self.map.insert(
            (def.component.clone(), def.vhost.clone(), def.name.clone()),
            def,
        )
    }

    pub fn remove(&mut self, component: &str, vhost: &str, name: &str) -> Option<ParameterDef> {
        let gone = self
            .map
            .remove(&(component.to_owned(), vhost.to_owned(), name.to_owned()));
        if gone.is_some() {
            self.generation += 1;
        }
        gone
    }

    /// A vhost is gone: its parameters go with it. Returns them.
    pub fn forget_vhost(&mut self, vhost: &str) -> Vec<ParameterDef> {
        let keys: Vec<_> = self
            .map
            .keys()
            .filter(|(_, v, _)| v == vhost)
            .cloned()
            .collect();
        if !keys.is_empty() {
            self.generation += 1;
        }
        keys.into_iter()
            .filter_map(|k| self.map.remove(&k))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(component: &str, vhost: &str, name: &str, value: &str) -> ParameterDef {
        ParameterDef {
            component: component.into(),
            vhost: vhost.into(),
            name: name.into(),
            value: value.into(),
        }
    }

    #[test]
    fn kept_by_component_vhost_and_name() {
        let mut p = Parameters::default();
        assert!(p.put(def("shovel", "/", "a", "{}")).is_none());
        assert!(p.put(def("shovel", "other", "a", "{}")).is_none());
        assert!(p.put(def("federation-upstream", "/", "a", "{}")).is_none());
        let before = p.generation();
        assert_eq!(
            p.put(def("shovel", "/", "a", r#"{"x":1}"#))
                .map(|d| d.value),
            Some("{}".to_owned()),
            "a second set replaces"
        );
        assert!(p.generation() > before);
        assert_eq!(p.list(Some("shovel"), None).count(), 2);
        assert_eq!(p.list(None, Some("/")).count(), 2);
        assert_eq!(
            p.get("shovel", "/", "a").map(|d| d.value.as_str()),
            Some(r#"{"x":1}"#)
        );
        let g = p.generation();
        assert!(p.remove("shovel", "/", "missing").is_none());
        assert_eq!(p.generation(), g, "nothing removed, nothing to look at");
        let gone = p.forget_vhost("/");
        assert_eq!(gone.len(), 2);
        assert_eq!(p.list(None, None).count(), 1);
    }

    #[test]
    fn global_parameters_are_listed_only_when_asked_for() {
        let mut p = Parameters::default();
        p.put(def("shovel", "/", "a", "{}"));
        p.put(def(GLOBAL, "", CLUSTER_NAME, r#""prod-eu""#));
        assert_eq!(p.list(None, None).count(), 1, "not among a vhost's");
        assert_eq!(p.list(Some(GLOBAL), Some("")).count(), 1);
        assert_eq!(p.all().count(), 2, "a snapshot carries both");
        assert_eq!(p.global(CLUSTER_NAME), Some(r#""prod-eu""#));
    }
}
