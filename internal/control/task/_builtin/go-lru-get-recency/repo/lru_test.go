package lru

import (
	"reflect"
	"testing"
)

func TestPutEvictsOldest(t *testing.T) {
	c := New[string, int](2)
	var evicted []string
	c.OnEvict = func(k string, _ int) { evicted = append(evicted, k) }
	c.Put("a", 1)
	c.Put("b", 2)
	c.Put("c", 3)
	if _, ok := c.Get("a"); ok {
		t.Errorf("a should have been evicted")
	}
	if !reflect.DeepEqual(evicted, []string{"a"}) {
		t.Errorf("evicted = %v, want [a]", evicted)
	}
	if c.Len() != 2 {
		t.Errorf("Len = %d, want 2", c.Len())
	}
}

func TestPutExistingUpdatesValue(t *testing.T) {
	c := New[string, int](2)
	c.Put("a", 1)
	c.Put("b", 2)
	c.Put("a", 10)
	c.Put("c", 3) // b is now the oldest
	if v, ok := c.Get("a"); !ok || v != 10 {
		t.Errorf("Get(a) = %d, %v; want 10, true", v, ok)
	}
	if _, ok := c.Get("b"); ok {
		t.Errorf("b should have been evicted")
	}
}

func TestMissingKey(t *testing.T) {
	c := New[int, string](0)
	if v, ok := c.Get(42); ok || v != "" {
		t.Errorf("Get on empty cache = %q, %v", v, ok)
	}
	c.Put(1, "x")
	c.Put(2, "y")
	if c.Len() != 1 {
		t.Errorf("capacity below 1 should be treated as 1, Len = %d", c.Len())
	}
}

func TestGetRefreshesRecency(t *testing.T) {
	c := New[string, int](2)
	c.Put("a", 1)
	c.Put("b", 2)
	c.Get("a") // a is now the most recently used
	c.Put("c", 3)
	if _, ok := c.Get("a"); !ok {
		t.Errorf("a was read before c was added and should still be cached")
	}
	if _, ok := c.Get("b"); ok {
		t.Errorf("b is the least recently used entry and should have been evicted")
	}
}

func TestKeysOrderAfterGet(t *testing.T) {
	c := New[string, int](3)
	c.Put("a", 1)
	c.Put("b", 2)
	c.Put("c", 3)
	c.Get("a")
	if got, want := c.Keys(), []string{"a", "c", "b"}; !reflect.DeepEqual(got, want) {
		t.Errorf("Keys = %v, want %v", got, want)
	}
}
