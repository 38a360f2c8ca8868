// Package cas owns the content-addressed tree store behind the local
// provider's file-only snapshots: it stores a directory tree (a sandbox's
// writable tree) in a blob.Store, deduplicated across snapshots and trees,
// and materialises it again for forks. It also stores a stream written in
// place into a blob store's pack file as a one-file tree, cut where the
// caller's Chunker says (StageFile: the microVM provider's saved states),
// and streams a file back (CatFile).
//
// A snapshot is a manifest plus chunks. Every regular file is cut into
// chunks, each stored as one blob whose key is the blake3-256 hash of its
// bytes, so a chunk shared by two files, two snapshots or two sandboxes is
// stored once. The manifest lists every entry of the tree with its
// metadata and, for files, the keys and lengths of its chunks; it is itself
// a blob, and its key is the snapshot's id. Every blob is checked against
// its key and length when read back: a damaged store makes Restore fail
// with ErrCorrupt, never restore something else.
//
// Chunking is content-defined, with github.com/restic/chunker (Rabin
// fingerprints over a 64-byte window; chunks of 512 KiB to 8 MiB, 1 MiB on
// average, with a fixed polynomial so that cuts agree across snapshots and
// trees). Content-defined cuts follow the content rather than offsets, so
// an insertion or an append to a large file (a log, a database, a model
// checkpoint) re-stores only the chunks around the change, where fixed-size
// chunks would shift every chunk after it. Files below the minimum chunk
// size, most files of a source tree, are one chunk each.
//
// A snapshot made with the id of the previous snapshot of the same tree
// does not read files whose size, mtime, ctime, inode and device are
// unchanged: they keep their chunks. Its cost in time and bytes follows
// what changed, not the tree's size (a walk with one lstat per entry, and
// the manifest, remain). A file changed within a timestamp tick of being
// read is marked racy and read again next time, since a second change in
// the same tick would leave its stat as it was. The previous snapshot's
// chunks are taken as stored when this Store wrote or checked that
// snapshot since its last GC; otherwise each is looked up first (any copy,
// however old, counts: blob.AnyHaver), and a file with a chunk gone is
// read again. The caller's GC must keep the previous snapshot, as a
// provider keeps a sandbox's base.
//
// The manifest is a compact, versioned binary encoding (see manifest.go),
// decoded strictly: a manifest that could write outside the destination,
// or is anything but the canonical encoding of a valid tree, is refused
// before anything is written. Every blob is durable before Snapshot
// returns, the manifest last. Memory: the tree's metadata (one manifest
// entry per path), and for content at most eight files in flight, each
// holding one chunk (at most 8 MiB) and a 512 KiB read buffer.
package cas

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/restic/chunker"
	"github.com/zeebo/blake3"

	"stasis/internal/fsclock"
	"stasis/internal/storage/blob"
)

// ErrCorrupt is wrapped by every error about a chunk or a manifest whose
// bytes do not match its key or its recorded length. It is blob.ErrCorrupt,
// so that a blob store's own refusal of a damaged blob reads the same.
var ErrCorrupt = blob.ErrCorrupt

// polynomial is the chunker's Rabin polynomial: irreducible, of degree 53,
// derived with chunker.DerivePolynomial from the blake3 XOF of
// "stasis cas chunker polynomial v1" (TestPolynomial checks this). Changing
// it changes every cut, and so ends deduplication against older snapshots.
const polynomial = chunker.Pol(0x339ca55aadf609)

// maxChunk bounds a chunk's size: the chunker's default maximum.
const maxChunk = chunker.MaxSize

// Store is a content-addressed tree store over a blob.Store. It is safe
// for concurrent use, except that GC must not run while a Snapshot does.
type Store struct {
	blobs   blob.Store
	workers int           // files chunked, hashed and stored (or restored) at once
	racy    time.Duration // see fsclock.RacyWindow (applied to ctimes); tests set it
	// minChunk and avgBits set the chunker's cuts (zero: its defaults,
	// 512 KiB minimum and 1 MiB on average). Tests set them to cut small
	// files into many chunks; restores read any chunking.
	minChunk uint
	avgBits  int

	mu sync.Mutex
	// complete holds the ids of manifests whose every chunk this Store has
	// seen in the blob store since its last GC: the manifests it wrote, and
	// those whose chunks it checked. A Snapshot with such a prev reuses
	// unchanged files' chunks without asking the blob store for each.
	complete map[string]bool
}

// workers: enough to overlap many blobs' fsyncs (file systems commit
// concurrent fsyncs together); each holds at most one chunk (8 MiB) and the
// chunker's 512 KiB buffer.
const workers = 8

// New returns a tree store keeping its blobs in b.
func New(b blob.Store) *Store {
	return &Store{blobs: b, workers: workers, racy: fsclock.RacyWindow(), complete: map[string]bool{}}
}

func (s *Store) isComplete(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.complete[id]
}

func (s *Store) setComplete(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.complete) >= 1<<14 { // bound the memory; forgetting only costs checks
		clear(s.complete)
	}
	s.complete[id] = true
}

// Stats describes one Snapshot or Restore.
type Stats struct {
	Files     int   `json:"files"`     // regular files (a set of hard links counts once)
	Dirs      int   `json:"dirs"`      // directories below the root
	Symlinks  int   `json:"symlinks"`  // symbolic links
	Hardlinks int   `json:"hardlinks"` // extra names of a regular file already counted
	Bytes     int64 `json:"bytes"`     // the tree's size: the sum of its regular files' sizes
	// ReadBytes is the file bytes read: from the tree by Snapshot, from the
	// blob store by Restore.
	ReadBytes   int64         `json:"read_bytes"`
	NewBlobs    int           `json:"new_blobs"`    // blobs Snapshot added to the store, the manifest included
	NewBytes    int64         `json:"new_bytes"`    // bytes Snapshot wrote to the blob store
	ReusedFiles int           `json:"reused_files"` // files Snapshot took unread from the previous snapshot
	Skipped     []string      `json:"skipped"`      // sockets, FIFOs and devices, by path: named, not stored
	Duration    time.Duration `json:"duration_ns"`
}

// chunkRef is one chunk of a file: its blob key and length.
type chunkRef struct {
	Key  string `json:"key"`
	Size int64  `json:"size"`
}

// hashKey is the blob key of data.
func hashKey(data []byte) string {
	sum := blake3.Sum256(data)
	return hex.EncodeToString(sum[:])
}

// verifyChunk checks data against the chunk it should be: its length and
// its hash. The error wraps ErrCorrupt.
func verifyChunk(ref chunkRef, data []byte) error {
	if int64(len(data)) != ref.Size {
		return fmt.Errorf("chunk %s: %w: %d bytes, want %d", ref.Key, ErrCorrupt, len(data), ref.Size)
	}
	if got := hashKey(data); got != ref.Key {
		return fmt.Errorf("chunk %s: %w: its content hashes to %s", ref.Key, ErrCorrupt, got)
	}
	return nil
}

// readChunk reads one chunk from the blob store and verifies it. A chunk
// missing from the store is corruption too (the error wraps both ErrCorrupt
// and blob.ErrNotFound).
func readChunk(ctx context.Context, b blob.Store, ref chunkRef) ([]byte, error) {
	data, err := b.Get(ctx, ref.Key)
	if errors.Is(err, blob.ErrNotFound) {
		return nil, fmt.Errorf("chunk %s: %w: missing from the blob store: %w", ref.Key, ErrCorrupt, err)
	}
	if err != nil {
		return nil, fmt.Errorf("chunk %s: %w", ref.Key, err)
	}
	if err := verifyChunk(ref, data); err != nil {
		return nil, err
	}
	return data, nil
}
