// Package blob owns stasis's blob stores: immutable byte strings filed
// under content keys (the lowercase hex of a 32-byte blake3 hash). Store is
// the small interface the rest of stasis consumes (the content-addressed
// tree store in package cas is its first user); Dir is the directory
// implementation, the default on one host, which keeps each batch of blobs
// as one pack file and its index (Batcher), takes a file written in place
// by someone else as a pack (PackFiler), and deletes many blobs a pack at
// a time (BulkDeleter). A store does not hash what it is given: the key is
// the caller's claim, and readers verify (package cas checks every blob it
// reads).
//
// S3 is the implementation over an S3 bucket shared by many nodes (see
// s3.go). It lives in this package rather than a sub-package because it
// stores the very same packs: it writes and reads the index and dead-list
// encodings of pack.go (encodeIndex, decodeIndex, encodeDead, decodeDead),
// whose single definition, fuzzed once, should not be exported for it. S3
// verifies every blob it reads against its key itself (ErrCorrupt), and
// implements Ager, which lets a collector on one node spare the blobs
// other nodes stored while it looked.
package blob

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// KeyLen is the length of every key: 64 lowercase hex digits, a 32-byte
// blake3 hash.
const KeyLen = 64

var (
	// ErrNotFound is returned (wrapped) by Get for a key that is not stored.
	ErrNotFound = errors.New("blob not found")
	// ErrInvalidKey is returned (wrapped) for a key that is not 64 lowercase
	// hex digits.
	ErrInvalidKey = errors.New("invalid blob key")
	// ErrCorrupt is returned (wrapped) by a store that verifies what it
	// reads (S3) for a blob whose bytes do not hash to its key. Package
	// cas's ErrCorrupt is the same error.
	ErrCorrupt = errors.New("corrupt blob")
)

// Store holds blobs by key. Implementations are safe for concurrent use.
type Store interface {
	// Put stores data under key. It is idempotent: putting a key already
	// stored changes nothing. When Put returns nil the blob is durable.
	Put(ctx context.Context, key string, data []byte) error
	// Get returns the blob stored under key; errors.Is(err, ErrNotFound)
	// when there is none.
	Get(ctx context.Context, key string) ([]byte, error)
	// Has reports whether key is stored.
	Has(ctx context.Context, key string) (bool, error)
	// Delete removes key; deleting a key not stored is not an error.
	Delete(ctx context.Context, key string) error
	// Walk calls fn for every stored key with the blob's size, in no
	// particular order; an error from fn stops the walk and is returned.
	Walk(ctx context.Context, fn func(key string, size int64) error) error
}

// ValidKey reports whether key is a well-formed blob key.
func ValidKey(key string) bool { return len(key) == KeyLen && lowerHex(key) }

func lowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// CheckKey returns an error wrapping ErrInvalidKey unless key is valid.
func CheckKey(key string) error {
	if ValidKey(key) {
		return nil
	}
	show := key
	if len(show) > 80 {
		show = show[:80] + "..."
	}
	return fmt.Errorf("blob key %q: %w: want %d lowercase hex digits (a blake3-256 hash)", show, ErrInvalidKey, KeyLen)
}

// BulkDeleter is implemented by stores that delete many blobs at once
// far more cheaply than one at a time (package cas's GC uses it).
type BulkDeleter interface {
	// DeleteKeys deletes every key, like Delete does one.
	DeleteKeys(ctx context.Context, keys []string) error
}

// Batcher is implemented by stores that can make many blobs durable
// together, which is far cheaper than one at a time.
type Batcher interface {
	NewBatch() Batch
}

// Batch collects blobs that become durable and visible together.
type Batch interface {
	// Stage adds a blob to the batch. It is neither durable nor visible to
	// Get, Has or Walk before Commit returns.
	Stage(ctx context.Context, key string, data []byte) error
	// Commit makes every staged blob durable and visible: when it returns
	// nil, all are; when it fails, each is either whole or absent.
	Commit(ctx context.Context) error
	// Abort drops whatever is staged and not committed.
	Abort()
}

// Ager is implemented by stores that know when each blob was stored, so
// that a collector sharing the store with writers it cannot stop (other
// nodes on one S3 bucket) can spare what they stored while it looked, and
// what they stored shortly before (package cas's GC grace period).
type Ager interface {
	// WalkStored is Walk with each blob's store time: when the newest of
	// its copies was stored, by the store's clock, rounded up (never
	// earlier than it was). It returns asOf, a time by the same clock such
	// that a blob stored after it may be missing from the walk: the walk
	// shows everything stored before asOf, and perhaps more.
	WalkStored(ctx context.Context, fn func(key string, size int64, stored time.Time) error) (asOf time.Time, err error)
	// DeleteStoredBefore deletes the copies of keys stored before t and
	// leaves any stored at or after t (another node's, written since the
	// walk), as DeleteKeys does otherwise.
	DeleteStoredBefore(ctx context.Context, keys []string, t time.Time) error
}

// AnyHaver is implemented by stores whose Has may leave out old copies
// (S3 with S3Options.ReuseWithin), so that a writer stores such a blob
// anew rather than rely on a copy a collector elsewhere may be deleting.
type AnyHaver interface {
	// HasAny reports whether any copy of key is stored, however old: for
	// a caller whose blobs every collector keeps by other means (package
	// cas's check of the previous snapshot's chunks, which a provider
	// keeps as a sandbox's base).
	HasAny(ctx context.Context, key string) (bool, error)
}
