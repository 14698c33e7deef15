//! Namespace ids: the small integer each namespace (model, tenant) is stored under in the prefix
//! table's entries. Handed out here, once, in decision order (the next after the newest, 0 being
//! 0.1.7's imported entries'), and persisted as the effect says.

use std::collections::HashMap;

use super::effect::Effect;
use crate::error::{Error, Result};
use crate::keys::Namespace;

/// The namespace id of entries imported from 0.1.7 (model unknown: FNV cannot be inverted).
pub(crate) const LEGACY_NAMESPACE: u32 = 0;

/// Every namespace id handed out, by the namespace's public id ([`Namespace::id`]).
#[derive(Debug, Default)]
pub(crate) struct Namespaces {
    ids: HashMap<[u8; 8], u32>,
    /// The next id to hand out.
    next: u32,
}

impl Namespaces {
    /// The ids of a file: `ids` (public id, id), and the next to hand out (its meta record's).
    pub(crate) fn new(ids: HashMap<[u8; 8], u32>, next: u32) -> Namespaces {
        Namespaces { ids, next: next.max(LEGACY_NAMESPACE + 1) }
    }

    /// Whether `namespace` has an id or one can be handed out.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] past 2^32 namespaces.
    pub(crate) fn has_room(&self, namespace: &Namespace) -> Result<()> {
        match self.ids.contains_key(&namespace.id()) || self.next < u32::MAX {
            true => Ok(()),
            false => Err(Error::InvalidConfig { detail: "more than 2^32 namespaces".into() }),
        }
    }

    /// The id of `namespace`, handed out if it has none (then with its effect).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] past 2^32 namespaces.
    pub(crate) fn id(&mut self, namespace: &Namespace, effects: &mut Vec<Effect>) -> Result<u32> {
        let public = namespace.id();
        if let Some(&id) = self.ids.get(&public) {
            return Ok(id);
        }
        self.has_room(namespace)?;
        let id = self.next;
        // Below u32::MAX (`has_room`): the next id is there.
        self.next = id.saturating_add(1);
        self.ids.insert(public, id);
        effects.push(Effect::Namespace { id, namespace: namespace.clone() });
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_namespace_gets_the_next_id_once() -> Result<()> {
        let (a, b) = (Namespace::new("a")?, Namespace::new("b")?);
        let mut ids = Namespaces::new(HashMap::from([(a.id(), 1)]), 2);
        let mut effects = Vec::new();
        assert_eq!(ids.id(&a, &mut effects)?, 1, "a known namespace keeps its id");
        assert!(effects.is_empty(), "and has no effect");
        assert_eq!(ids.id(&b, &mut effects)?, 2);
        assert_eq!(ids.id(&b, &mut effects)?, 2);
        assert!(matches!(effects.as_slice(), [Effect::Namespace { id: 2, .. }]), "{effects:?}");
        // A fresh file hands out 1 first: 0 is 0.1.7's.
        assert_eq!(Namespaces::new(HashMap::new(), 0).id(&a, &mut effects)?, 1);
        // Past 2^32, a new namespace is refused and nothing is handed out; known ones keep theirs.
        let mut full = Namespaces::new(HashMap::from([(a.id(), 1)]), u32::MAX);
        assert!(matches!(full.id(&b, &mut effects), Err(Error::InvalidConfig { .. })));
        assert!(full.has_room(&b).is_err() && full.has_room(&a).is_ok());
        assert_eq!(full.id(&a, &mut effects)?, 1);
        Ok(())
    }
}
