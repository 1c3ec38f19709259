//! An insertion-ordered map with O(log n) removal: the shape of a Python `dict` the engine
//! relies on (leases in lease order, consumers in subscription order), where removing from
//! the middle must not cost a shift of everything after it.

use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::hash::Hash;

#[derive(Clone, Debug)]
pub struct OrderedMap<K: Eq + Hash + Clone, V> {
    slots: FxHashMap<K, (u64, V)>,
    order: BTreeMap<u64, K>,
    next: u64,
}

impl<K: Eq + Hash + Clone, V> Default for OrderedMap<K, V> {
    fn default() -> Self {
        Self { slots: FxHashMap::default(), order: BTreeMap::new(), next: 0 }
    }
}

impl<K: Eq + Hash + Clone, V> OrderedMap<K, V> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn contains_key(&self, key: &K) -> bool {
        self.slots.contains_key(key)
    }

    pub fn get(&self, key: &K) -> Option<&V> {
        self.slots.get(key).map(|(_, v)| v)
    }

    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.slots.get_mut(key).map(|(_, v)| v)
    }

    /// Like `dict[key] = value`: a key already there keeps its place.
    pub fn insert(&mut self, key: K, value: V) {
        if let Some(slot) = self.slots.get_mut(&key) {
            slot.1 = value;
            return;
        }
        let at = self.next;
        self.next += 1;
        self.order.insert(at, key.clone());
        self.slots.insert(key, (at, value));
    }

    /// Like `del dict[key]` (None when absent).
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let (at, value) = self.slots.remove(key)?;
        self.order.remove(&at);
        Some(value)
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.order.values()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.order.values().map(move |k| (k, &self.slots[k].1))
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.order.values().map(move |k| &self.slots[k].1)
    }

    /// Every value, mutably, in no particular order.
    pub fn values_mut_unordered(&mut self) -> impl Iterator<Item = &mut V> {
        self.slots.values_mut().map(|(_, v)| v)
    }

    pub fn keys_vec(&self) -> Vec<K> {
        self.order.values().cloned().collect()
    }

    pub fn clear(&mut self) {
        self.slots.clear();
        self.order.clear();
    }
}

/// An insertion-ordered set (a Python `dict[K, None]`).
#[derive(Clone, Debug)]
pub struct OrderedSet<K: Eq + Hash + Clone> {
    map: OrderedMap<K, ()>,
}

impl<K: Eq + Hash + Clone> Default for OrderedSet<K> {
    fn default() -> Self {
        Self { map: OrderedMap::new() }
    }
}

impl<K: Eq + Hash + Clone> OrderedSet<K> {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    pub fn insert(&mut self, key: K) {
        self.map.insert(key, ());
    }
    pub fn remove(&mut self, key: &K) -> bool {
        self.map.remove(key).is_some()
    }
    pub fn iter(&self) -> impl Iterator<Item = &K> {
        self.map.keys()
    }
    pub fn to_vec(&self) -> Vec<K> {
        self.map.keys_vec()
    }
    pub fn clear(&mut self) {
        self.map.clear()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_insertion_order_and_place_on_update() {
        let mut m = OrderedMap::new();
        m.insert("a", 1);
        m.insert("b", 2);
        m.insert("c", 3);
        m.insert("a", 4);
        assert_eq!(m.keys_vec(), vec!["a", "b", "c"]);
        assert_eq!(m.remove(&"b"), Some(2));
        m.insert("b", 5);
        assert_eq!(m.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
                   vec![("a", 4), ("c", 3), ("b", 5)]);
    }
}
