package cas

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

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

// GC deletes every blob that no snapshot in live references, as GCWith
// does with no grace period.
func (s *Store) GC(ctx context.Context, live []string) (freedBlobs int, freedBytes int64, err error) {
	return s.GCWith(ctx, live, GCOptions{})
}

// GCOptions tunes GCWith.
type GCOptions struct {
	// Grace spares every blob stored less than Grace before the walk of
	// the store began, referenced or not: the chunks of snapshots being
	// made elsewhere (on other nodes sharing an S3 bucket), which no live
	// manifest references yet. It needs a store that records when it
	// stored each blob (blob.Ager). Make it longer than the longest
	// snapshot, plus the clock skew between the nodes and the store; see
	// also blob.S3Options.ReuseWithin, for the blobs such a snapshot
	// reuses rather than stores.
	Grace time.Duration
	// Optional are snapshots kept like the live ones when they are there;
	// one whose manifest is not in the store is passed over instead of
	// stopping the collection (what another node published as in use,
	// which a collection elsewhere may have freed before it was
	// published, and which nothing can rely on since).
	Optional []string
}

// GCWith deletes every blob that no snapshot in live references,
// manifests of other snapshots included, and returns how many blobs and
// bytes it freed. Every live snapshot is read and checked first: if one
// cannot be, nothing is deleted.
//
// On a store that knows when it stored each blob (blob.Ager, as S3 is), a
// blob stored after the walk of the store began, or less than o.Grace
// before, is never deleted, whether referenced or not, nor is a copy of
// an old blob stored again since then (a copy's store time is its own).
// Otherwise (Dir) o.Grace must be 0, and the caller guarantees that no
// Snapshot runs meanwhile (its new chunks are referenced by no manifest
// yet).
func (s *Store) GCWith(ctx context.Context, live []string, o GCOptions) (freedBlobs int, freedBytes int64, err error) {
	if o.Grace < 0 {
		return 0, 0, fmt.Errorf("gc: a negative grace period (%s); nothing was deleted", o.Grace)
	}
	ager, aged := s.blobs.(blob.Ager)
	if o.Grace > 0 && !aged {
		return 0, 0, fmt.Errorf("gc: a grace period needs a blob store that records when it stored each blob (blob.Ager), and %T does not; give 0, with no snapshot running; nothing was deleted", s.blobs)
	}
	keep := map[string]bool{}
	for i, id := range append(live[:len(live):len(live)], o.Optional...) {
		keys, err := s.Chunks(ctx, id)
		if i >= len(live) && errors.Is(err, blob.ErrNotFound) {
			slog.Warn("gc: a snapshot kept if it is there is not; passed over", "manifest", id)
			continue
		}
		if err != nil {
			return 0, 0, fmt.Errorf("gc: live %w; nothing was deleted", err)
		}
		for _, k := range keys {
			keep[k] = true
		}
	}
	type doomed struct {
		key    string
		size   int64
		stored time.Time
	}
	var del []doomed
	var cutoff time.Time
	if aged {
		asOf, err := ager.WalkStored(ctx, func(key string, size int64, stored time.Time) error {
			if !keep[key] {
				del = append(del, doomed{key, size, stored})
			}
			return nil
		})
		if err != nil {
			return 0, 0, fmt.Errorf("gc: %w; nothing was deleted", err)
		}
		cutoff = asOf.Add(-o.Grace)
		n := 0
		for _, d := range del {
			if d.stored.Before(cutoff) {
				del[n] = d
				n++
			}
		}
		del = del[:n]
	} else if err := s.blobs.Walk(ctx, func(key string, size int64) error {
		if !keep[key] {
			del = append(del, doomed{key: key, size: size})
		}
		return nil
	}); err != nil {
		return 0, 0, fmt.Errorf("gc: %w; nothing was deleted", err)
	}
	s.mu.Lock()
	clear(s.complete) // what this Store knew to be stored may go now
	s.mu.Unlock()
	if aged || isBulk(s.blobs) {
		keys := make([]string, len(del))
		for i, d := range del {
			keys[i] = d.key
			freedBytes += d.size
		}
		if aged {
			err = ager.DeleteStoredBefore(ctx, keys, cutoff)
		} else {
			err = s.blobs.(blob.BulkDeleter).DeleteKeys(ctx, keys)
		}
		if err != nil {
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

func isBulk(b blob.Store) bool {
	_, ok := b.(blob.BulkDeleter)
	return ok
}
