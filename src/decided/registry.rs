//! The node registry: every node incarnation by id, its name, and whether it was forgotten. A
//! name's current incarnation is its newest not forgotten; a forgotten node that runs again
//! gets the next id.

use std::collections::HashMap;
use std::sync::Arc;

use super::effect::Effect;
use crate::error::{Error, Result};

/// Every node incarnation by id (nodes are few, so all of them are kept in memory).
#[derive(Default)]
pub(crate) struct Registry {
    /// Names by id.
    names: Vec<Arc<str>>,
    /// The current (not forgotten) id of each name.
    ids: HashMap<Arc<str>, u32>,
    /// By id: whether that incarnation was forgotten.
    retired: Vec<bool>,
}

impl Registry {
    /// The registry of a file's node records: names by id, and by id whether that incarnation
    /// was forgotten. The newest live incarnation of each name is its current id.
    pub(crate) fn new(names: Vec<Arc<str>>, retired: Vec<bool>) -> Registry {
        let ids = (0u32..).zip(&names).zip(&retired).filter(|&(_, gone)| !gone).map(|((id, n), _)| (Arc::clone(n), id));
        Registry { ids: ids.collect(), names, retired }
    }

    /// Ids handed out: the next id is this one.
    pub(crate) fn next_id(&self) -> u32 {
        u32::try_from(self.names.len()).unwrap_or(u32::MAX)
    }

    /// Forgets `name`'s current incarnation: its id and shared name, `None` if it has none.
    pub(crate) fn forget(&mut self, name: &str) -> Option<(u32, Arc<str>)> {
        let id = self.ids.remove(name)?;
        let name = self.names.get(id as usize).map(Arc::clone)?;
        if let Some(r) = self.retired.get_mut(id as usize) {
            *r = true;
        }
        Some((id, name))
    }

    /// Whether node id `node` was forgotten.
    pub(crate) fn is_retired(&self, node: u32) -> bool {
        self.retired.get(node as usize).copied().unwrap_or(false)
    }

    /// The name of node id `node`.
    pub(crate) fn name(&self, node: u32) -> String {
        self.name_of(node).map_or_else(|| format!("#{node}"), str::to_string)
    }

    /// The name of node id `node`, if it has one.
    pub(crate) fn name_of(&self, node: u32) -> Option<&str> {
        self.names.get(node as usize).map(|n| n.as_ref())
    }

    /// The current id of node `name`, if it has one.
    pub(crate) fn current(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// Every incarnation by id: its name and whether it was forgotten.
    pub(crate) fn all(&self) -> impl Iterator<Item = (&str, bool)> + '_ {
        self.names.iter().map(|n| n.as_ref()).zip(self.retired.iter().copied())
    }

    /// The current incarnations: (id, name).
    pub(crate) fn current_ids(&self) -> Vec<(u32, Arc<str>)> {
        (0u32..).zip(&self.names).filter(|&(id, _)| !self.is_retired(id)).map(|(id, n)| (id, Arc::clone(n))).collect()
    }

    /// The current id of node `name`, handed out if it has none (then with its effect), and
    /// a shared copy of the name.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] past 2^32 node incarnations.
    pub(crate) fn id(&mut self, name: &str, effects: &mut Vec<Effect>) -> Result<(u32, Arc<str>)> {
        if let Some(&id) = self.ids.get(name)
            && let Some(known) = self.names.get(id as usize)
        {
            return Ok((id, Arc::clone(known)));
        }
        let id = u32::try_from(self.names.len())
            .map_err(|_| Error::InvalidConfig { detail: "more than 2^32 node incarnations".into() })?;
        let shared: Arc<str> = Arc::from(name);
        self.names.push(Arc::clone(&shared));
        self.retired.push(false);
        self.ids.insert(Arc::clone(&shared), id);
        effects.push(Effect::Node { id, name: Arc::clone(&shared) });
        Ok((id, shared))
    }
}
