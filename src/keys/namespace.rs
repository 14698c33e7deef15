//! `Namespace`: where a prefix lives (a model, and optionally a tenant), the seed of its chain,
//! and the limits on every name the index is given.

use std::sync::Arc;

use super::chain::{self, BlockKey, Scheme};
use crate::error::{Error, Result};

/// Longest model name accepted, in bytes.
pub const MAX_MODEL_BYTES: usize = 1024;
/// Longest tenant salt accepted, in bytes.
pub const MAX_TENANT_BYTES: usize = 1024;
/// Longest node name accepted, in bytes.
pub const MAX_NODE_BYTES: usize = 255;

const NS_CONTEXT: &str = "superfluid-warm 2026-12 prefix namespace v1";

/// Where a prefix lives: a model, and optionally a tenant whose prefixes nobody else shares.
/// Cheap to clone.
#[derive(Clone, PartialEq, Eq)]
pub struct Namespace {
    inner: Arc<NamespaceInner>,
}

#[derive(PartialEq, Eq)]
struct NamespaceInner {
    model: String,
    tenant: Option<Vec<u8>>,
    key: [u8; 32],
    id: [u8; 8],
}

impl std::fmt::Debug for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the tenant salt or the key.
        f.debug_struct("Namespace")
            .field("model", &self.inner.model)
            .field("tenant", &self.inner.tenant.is_some())
            .field("id", &super::hex(&self.inner.id))
            .finish()
    }
}

impl Namespace {
    /// The namespace of a model shared by everyone.
    ///
    /// # Errors
    /// [`Error::InvalidName`] if `model` is empty or over [`MAX_MODEL_BYTES`].
    pub fn new(model: &str) -> Result<Namespace> {
        Self::build(model, None)
    }

    /// The namespace of a model for one tenant: two tenants never share a prefix, even for the
    /// same model and tokens.
    ///
    /// # Errors
    /// [`Error::InvalidName`] if `model` or `tenant` is empty or over its limit.
    pub fn with_tenant(model: &str, tenant: &[u8]) -> Result<Namespace> {
        check_len("tenant", tenant.len(), MAX_TENANT_BYTES)?;
        Self::build(model, Some(tenant))
    }

    /// [`Namespace::with_tenant`] with a tenant, [`Namespace::new`] without one.
    ///
    /// # Errors
    /// As those.
    pub fn of(model: &str, tenant: Option<&[u8]>) -> Result<Namespace> {
        match tenant {
            Some(t) => Namespace::with_tenant(model, t),
            None => Namespace::new(model),
        }
    }

    fn build(model: &str, tenant: Option<&[u8]>) -> Result<Namespace> {
        check_name("model", model, MAX_MODEL_BYTES)?;
        let mut material = Vec::with_capacity(16 + model.len() + tenant.map_or(0, <[u8]>::len));
        material.extend_from_slice(&(model.len() as u64).to_le_bytes());
        material.extend_from_slice(model.as_bytes());
        match tenant {
            Some(t) => {
                material.push(1);
                material.extend_from_slice(&(t.len() as u64).to_le_bytes());
                material.extend_from_slice(t);
            }
            None => material.push(0),
        }
        let key = blake3::derive_key(NS_CONTEXT, &material);
        let mut id = [0; 8];
        id.copy_from_slice(&blake3::hash(&key).as_bytes()[..8]);
        Ok(Namespace {
            inner: Arc::new(NamespaceInner { model: model.to_string(), tenant: tenant.map(<[u8]>::to_vec), key, id }),
        })
    }

    #[cfg(feature = "nats")]
    /// A namespace as another head's event names it: its model, whether it is a tenant's and
    /// its public id, without the tenant salt or the chain key (it can name entries, never
    /// hash tokens). Without a tenant the id must be the model's.
    ///
    /// `None` for an empty or over-long model name, or an id that is not the model's.
    pub(crate) fn received(model: &str, tenant: bool, id: [u8; 8]) -> Option<Namespace> {
        let plain = Namespace::new(model).ok()?;
        if !tenant {
            return (plain.id() == id).then_some(plain);
        }
        Some(Namespace {
            inner: Arc::new(NamespaceInner { model: model.to_string(), tenant: Some(Vec::new()), key: [0; 32], id }),
        })
    }

    /// The tenant, if it is a tenant's namespace.
    pub(crate) fn tenant(&self) -> Option<&[u8]> {
        self.inner.tenant.as_deref()
    }

    /// The model name.
    pub fn model(&self) -> &str {
        &self.inner.model
    }

    /// Whether this namespace is a tenant's own.
    pub fn has_tenant(&self) -> bool {
        self.inner.tenant.is_some()
    }

    /// A short public id of this namespace (never the tenant salt): the first 8 bytes of a hash
    /// of its key.
    pub fn id(&self) -> [u8; 8] {
        self.inner.id
    }

    /// The key of every whole block of `tokens`, in order, in the scheme of new files (v3).
    pub fn chain(&self, tokens: &[u32]) -> Vec<BlockKey> {
        self.chain_in(Scheme::TreeChain, tokens)
    }

    /// The key of every whole block of `tokens`, in order, in `scheme`.
    pub(crate) fn chain_in(&self, scheme: Scheme, tokens: &[u32]) -> Vec<BlockKey> {
        chain::block_keys(scheme, &self.inner.key, tokens)
    }

    /// The chain's seed: never shown, never stored.
    pub(crate) fn key(&self) -> &[u8; 32] {
        &self.inner.key
    }
}

/// Checks a name's length against its limit.
///
/// # Errors
/// [`Error::InvalidName`] if it is empty or over `max`.
pub(crate) fn check_len(what: &'static str, len: usize, max: usize) -> Result<()> {
    if len == 0 || len > max {
        return Err(Error::InvalidName { what, len, max });
    }
    Ok(())
}

/// Checks a name of text (a model's, a node's): 1 to `max` bytes, without a NUL byte (a C
/// string, a log line or a label would cut it short there).
///
/// # Errors
/// [`Error::InvalidName`] if it is empty or over `max`; [`Error::NulInName`] for a NUL byte.
pub(crate) fn check_name(what: &'static str, name: &str, max: usize) -> Result<()> {
    check_len(what, name.len(), max)?;
    match name.bytes().position(|b| b == 0) {
        Some(at) => Err(Error::NulInName { what, at }),
        None => Ok(()),
    }
}

/// [`check_name`] for a node's name.
///
/// # Errors
/// As [`check_name`].
pub(crate) fn check_node(name: &str) -> Result<()> {
    check_name("node", name, MAX_NODE_BYTES)
}
