// Package lru implements a fixed-size least-recently-used cache.
package lru

import "container/list"

type entry[K comparable, V any] struct {
	key   K
	value V
}

// Cache holds at most Cap entries. When it is full, adding a new key evicts
// the entry that was least recently read or written.
type Cache[K comparable, V any] struct {
	cap   int
	order *list.List // front = most recently used
	items map[K]*list.Element

	// OnEvict, if set, is called with each entry removed to make room.
	OnEvict func(key K, value V)
}

// New returns an empty cache holding at most capacity entries (minimum 1).
func New[K comparable, V any](capacity int) *Cache[K, V] {
	if capacity < 1 {
		capacity = 1
	}
	return &Cache[K, V]{cap: capacity, order: list.New(), items: make(map[K]*list.Element)}
}

// Get returns the value stored for key and marks it as recently used.
func (c *Cache[K, V]) Get(key K) (V, bool) {
	if el, ok := c.items[key]; ok {
		return el.Value.(*entry[K, V]).value, true
	}
	var zero V
	return zero, false
}

// Put stores value under key, evicting the least recently used entry if the
// cache is full.
func (c *Cache[K, V]) Put(key K, value V) {
	if el, ok := c.items[key]; ok {
		el.Value.(*entry[K, V]).value = value
		c.order.MoveToFront(el)
		return
	}
	c.items[key] = c.order.PushFront(&entry[K, V]{key, value})
	if c.order.Len() > c.cap {
		oldest := c.order.Back()
		e := c.order.Remove(oldest).(*entry[K, V])
		delete(c.items, e.key)
		if c.OnEvict != nil {
			c.OnEvict(e.key, e.value)
		}
	}
}

// Len returns the number of entries in the cache.
func (c *Cache[K, V]) Len() int { return c.order.Len() }

// Keys returns the keys from most to least recently used.
func (c *Cache[K, V]) Keys() []K {
	keys := make([]K, 0, c.order.Len())
	for el := c.order.Front(); el != nil; el = el.Next() {
		keys = append(keys, el.Value.(*entry[K, V]).key)
	}
	return keys
}
