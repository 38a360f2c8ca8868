package cas

import (
	"context"
	"fmt"

	"stasis/internal/storage/blob"
)

// Chunks lists the blob keys snapshot id references: the manifest's own key
// first, then each chunk once, in manifest order.
func (s *Store) Chunks(ctx context.Context, id string) ([]string, error) {
	m, err := s.loadManifest(ctx, id)
	if err != nil {
		return nil, err
	}
	keys := []string{id}
	seen := map[string]bool{id: true}
	for i := range m.Entries {
		for _, c := range m.Entries[i].Chunks {
			if !seen[c.Key] {
				seen[c.Key] = true
				keys = append(keys, c.Key)
			}
		}
	}
	return keys, nil
}

// GC deletes every blob that no snapshot in live references, manifests of
// other snapshots included, and returns how many blobs and bytes it freed.
// Every live snapshot is read and checked first: if one cannot be, nothing
// is deleted. The caller guarantees that no Snapshot runs meanwhile (its
// new chunks are referenced by no manifest yet).
func (s *Store) GC(ctx context.Context, live []string) (freedBlobs int, freedBytes int64, err error) {
	keep := map[string]bool{}
	for _, id := range live {
		keys, err := s.Chunks(ctx, id)
		if err != nil {
			return 0, 0, fmt.Errorf("gc: live %w; nothing was deleted", err)
		}
		for _, k := range keys {
			keep[k] = true
		}
	}
	type doomed struct {
		key  string
		size int64
	}
	var del []doomed
	if err := s.blobs.Walk(ctx, func(key string, size int64) error {
		if !keep[key] {
			del = append(del, doomed{key, size})
		}
		return nil
	}); err != nil {
		return 0, 0, fmt.Errorf("gc: %w; nothing was deleted", err)
	}
	s.mu.Lock()
	clear(s.complete) // what this Store knew to be stored may go now
	s.mu.Unlock()
	if bd, ok := s.blobs.(blob.BulkDeleter); ok {
		keys := make([]string, len(del))
		for i, d := range del {
			keys[i] = d.key
			freedBytes += d.size
		}
		if err := bd.DeleteKeys(ctx, keys); err != nil {
			return 0, 0, fmt.Errorf("gc: %w", err)
		}
		return len(del), freedBytes, nil
	}
	for _, d := range del {
		if err := s.blobs.Delete(ctx, d.key); err != nil {
			return freedBlobs, freedBytes, fmt.Errorf("gc: %w (%d blobs freed before it)", err, freedBlobs)
		}
		freedBlobs++
		freedBytes += d.size
	}
	return freedBlobs, freedBytes, nil
}
