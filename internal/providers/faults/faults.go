// Package faults owns what the E2B and OpenSandbox fakes share of the
// faults a test injects: adding one to a fake's list or map, with the
// function that takes it out again. Matching a request and answering it
// stay with each fake, in its service's terms.
package faults

import "sync"

// Add appends ft to *list under mu; remove takes it out again, if it is
// still there (a fault that ran out may be gone already).
func Add[T comparable](mu *sync.Mutex, list *[]T, ft T) (remove func()) {
	mu.Lock()
	*list = append(*list, ft)
	mu.Unlock()
	return func() {
		mu.Lock()
		defer mu.Unlock()
		for i, x := range *list {
			if x == ft {
				*list = append((*list)[:i:i], (*list)[i+1:]...)
				return
			}
		}
	}
}

// Put sets m[k] to v under mu; remove deletes k again.
func Put[K comparable, V any](mu *sync.Mutex, m map[K]V, k K, v V) (remove func()) {
	mu.Lock()
	m[k] = v
	mu.Unlock()
	return func() {
		mu.Lock()
		delete(m, k)
		mu.Unlock()
	}
}
