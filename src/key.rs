//! Key encoding: namespace + user key → one store key per algorithm.
//!
//! The encoding is injective: no two (namespace, key) pairs give the same
//! store key, whatever bytes a user puts in either. Every store key carries
//! exactly one Redis Cluster hash tag, so each script runs on one slot, and
//! a user key containing braces can neither move its slot nor collide with
//! another key. Long keys are replaced by their SHA-256, so a 1 MB key costs
//! a 64-byte store key.
//!
//! Before a key reaches any per-process map (hybrid holdings, the per-process
//! limiter, the fallback and its reconciliation ledger), [`local_key`]
//! replaces a long one by a fixed-size digest, so what a client sends in a
//! header cannot make those maps grow by its own length.

use std::borrow::Cow;

use sha2::{Digest, Sha256};

use crate::algorithm::Algorithm;

/// Above this many encoded bytes, the tag is the SHA-256 of the raw key.
pub(crate) const MAX_TAG_LEN: usize = 128;

/// The prefix of every store key this crate writes.
pub(crate) const PREFIX: &str = "sl";

/// Keys up to this many bytes are used as they are; longer ones are
/// replaced by [`local_key`]'s digest form, one byte longer than this.
pub(crate) const MAX_LOCAL_KEY_LEN: usize = 64;

/// A key as the caller gave it and as this process keeps it (through
/// [`local_key`]): maps, lanes and the store see the kept one (it derefs
/// to it); a per-key quota resolver sees the one given, whatever its
/// length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Key<'a> {
    pub(crate) given: &'a str,
    pub(crate) kept: &'a str,
}

impl Key<'_> {
    /// A key short enough to be kept as given.
    #[inline]
    pub(crate) fn short(key: &str) -> Key<'_> {
        Key {
            given: key,
            kept: key,
        }
    }
}

impl std::ops::Deref for Key<'_> {
    type Target = str;

    #[inline]
    fn deref(&self) -> &str {
        self.kept
    }
}

/// The key a limiter works with: `key` itself when it is at most
/// [`MAX_LOCAL_KEY_LEN`] bytes, else `~` and the hex SHA-256 of `key`
/// (65 bytes). The digest form is longer than any key kept as it is, so
/// the mapping stays injective: no short key can equal a digest form.
#[inline]
pub(crate) fn local_key(key: &str) -> Cow<'_, str> {
    if key.len() <= MAX_LOCAL_KEY_LEN {
        return Cow::Borrowed(key);
    }
    let digest = Sha256::digest(key.as_bytes());
    let mut out = String::with_capacity(MAX_LOCAL_KEY_LEN + 1);
    out.push('~');
    for byte in digest {
        out.push(char::from(HEX[(byte >> 4) as usize]));
        out.push(char::from(HEX[(byte & 15) as usize]));
    }
    Cow::Owned(out)
}

/// Builds store keys for one namespace.
#[derive(Debug, Clone)]
pub(crate) struct KeyEncoder {
    namespace: String,
    /// A limiter's second and later quotas (`Builder::and`): `.1`, `.2`…
    /// after the algorithm's suffix, inside the same hash tag, so every
    /// quota of a key lives in one slot. Empty for the first.
    quota: String,
}

impl KeyEncoder {
    pub(crate) fn new(namespace: &str) -> Self {
        KeyEncoder {
            namespace: namespace.to_owned(),
            quota: String::new(),
        }
    }

    /// These keys for a quota of another period than the limiter's first
    /// (a tier, a `set_quota`): windows of different lengths have different
    /// indices, so they must not share a key (a short window's script would
    /// forget a long one's count as an old window).
    pub(crate) fn for_period(&self, period: std::time::Duration) -> Self {
        KeyEncoder {
            namespace: self.namespace.clone(),
            quota: format!("{}~{}", self.quota, period.as_micros()),
        }
    }

    /// These keys for a limiter's quota at `index` (0: the first).
    pub(crate) fn for_quota(&self, index: usize) -> Self {
        KeyEncoder {
            namespace: self.namespace.clone(),
            quota: if index == 0 {
                String::new()
            } else {
                format!(".{index}")
            },
        }
    }

    /// The namespace these keys live in.
    pub(crate) fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The hash tag body (without braces) for a user key.
    pub(crate) fn tag(&self, key: &str) -> String {
        let mut tag = String::with_capacity(self.namespace.len() + key.len() + 2);
        escape_into(&mut tag, &self.namespace);
        tag.push(':');
        escape_into(&mut tag, key);
        if tag.len() <= MAX_TAG_LEN {
            return tag;
        }
        // '#' never appears in an escaped tag, so hashed and plain tags
        // cannot collide; the length prefix keeps (ns, key) splits apart.
        let mut hasher = Sha256::new();
        hasher.update((self.namespace.len() as u64).to_be_bytes());
        hasher.update(self.namespace.as_bytes());
        hasher.update(key.as_bytes());
        let digest = hasher.finalize();
        let mut hashed = String::with_capacity(65);
        hashed.push('#');
        for byte in digest {
            hashed.push(char::from(HEX[(byte >> 4) as usize]));
            hashed.push(char::from(HEX[(byte & 15) as usize]));
        }
        hashed
    }

    /// The store key for a user key under an algorithm.
    pub(crate) fn store_key(&self, key: &str, algorithm: Algorithm) -> String {
        let tag = self.tag(key);
        let mut out = String::with_capacity(tag.len() + 10 + self.quota.len());
        out.push_str(PREFIX);
        out.push_str(":{");
        out.push_str(&tag);
        out.push_str("}:");
        out.push_str(algorithm.key_suffix());
        out.push_str(&self.quota);
        out
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Percent-escapes every byte outside `[A-Za-z0-9._-]`. ':' is escaped,
/// so the separator between namespace and key is unambiguous; braces are
/// escaped, so the tag has no '{' or '}'.
fn escape_into(out: &mut String, raw: &str) {
    for &byte in raw.as_bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'-') {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(char::from(HEX[(byte >> 4) as usize]));
            out.push(char::from(HEX[(byte & 15) as usize]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(ns: &str, k: &str) -> String {
        KeyEncoder::new(ns).store_key(k, Algorithm::FixedWindow)
    }

    fn single_tag(store_key: &str) -> &str {
        let open = store_key.find('{').expect("a hash tag");
        let close = store_key[open..].find('}').expect("closed") + open;
        assert!(close > open + 1, "empty hash tag in {store_key}");
        &store_key[open + 1..close]
    }

    #[test]
    fn braces_in_user_keys_do_not_move_the_slot() {
        let k = key("api", "{user1}");
        assert_eq!(k.matches('{').count(), 1);
        assert_eq!(single_tag(&k), "api:%7buser1%7d");
    }

    #[test]
    fn empty_keys_and_namespaces_are_distinct_and_tagged() {
        assert_ne!(key("", "a"), key("a", ""));
        assert_eq!(single_tag(&key("", "")), ":");
    }

    #[test]
    fn huge_keys_are_hashed_to_a_fixed_size() {
        let big = "x".repeat(1 << 20);
        let k = key("api", &big);
        assert!(k.len() < 100, "{}", k.len());
        assert_ne!(k, key("api", &"x".repeat((1 << 20) - 1)));
        assert_ne!(key("ap", &format!("i{big}")), k);
    }

    #[test]
    fn algorithms_get_separate_keys() {
        let e = KeyEncoder::new("n");
        assert_ne!(
            e.store_key("k", Algorithm::FixedWindow),
            e.store_key("k", Algorithm::TokenBucket)
        );
    }

    #[test]
    fn long_keys_are_bounded_before_any_local_map() {
        let short = "k".repeat(MAX_LOCAL_KEY_LEN);
        assert!(matches!(local_key(&short), Cow::Borrowed(_)));
        let header_sized = "x".repeat(64 << 10);
        let compact = local_key(&header_sized);
        assert_eq!(compact.len(), MAX_LOCAL_KEY_LEN + 1);
        assert_eq!(local_key(&"x".repeat(1 << 20)).len(), MAX_LOCAL_KEY_LEN + 1);
        assert_ne!(compact, local_key(&"x".repeat((64 << 10) + 1)));
    }

    proptest! {
        #[test]
        fn local_keys_are_injective(k1 in ".{0,80}", k2 in ".{0,80}") {
            prop_assume!(k1 != k2);
            prop_assert_ne!(local_key(&k1), local_key(&k2));
        }

        #[test]
        fn encoding_is_injective(
            ns1 in ".{0,12}", k1 in ".{0,40}",
            ns2 in ".{0,12}", k2 in ".{0,40}",
        ) {
            prop_assume!((ns1.as_str(), k1.as_str()) != (ns2.as_str(), k2.as_str()));
            prop_assert_ne!(key(&ns1, &k1), key(&ns2, &k2));
        }

        #[test]
        fn encoding_is_injective_across_the_hashing_threshold(
            ns in "[a-z:{}]{0,4}", k1 in "[a-z{}%#]{30,80}", k2 in "[a-z{}%#]{30,80}",
        ) {
            prop_assume!(k1 != k2);
            prop_assert_ne!(key(&ns, &k1), key(&ns, &k2));
        }

        #[test]
        fn every_key_has_exactly_one_nonempty_tag(ns in ".{0,10}", k in ".{0,300}") {
            let sk = key(&ns, &k);
            prop_assert_eq!(sk.matches('{').count(), 1);
            prop_assert_eq!(sk.matches('}').count(), 1);
            let _ = single_tag(&sk);
        }
    }
}
