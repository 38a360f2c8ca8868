package blob

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"stasis/internal/storage/atomicfile"
)

// stagingDir holds the batches being written; it is never a fan-out
// directory, so Get, Has and Walk never see what is in it, and NewDir
// clears what a crash left there.
const stagingDir = ".staging"

// staleStaging is the age past which a staging batch, or a pack without
// its index, is a crash's leftover.
const staleStaging = time.Hour

var _ Batcher = (*Dir)(nil)

// NewBatch starts a batch, which Commit makes one pack. Staged blobs are
// written, as they come and from any number of goroutines, at their own
// offsets in one file in a private staging directory; Commit makes that
// file and its index durable (one fsync each), renames both into the packs
// directory, the index last, and makes the renames durable. One file is
// created per batch, however many blobs it holds: creating a file per blob
// costs more than writing its bytes on a busy file system.
func (d *Dir) NewBatch() Batch {
	return &packBatch{d: d, id: newPackID(), entries: map[rawKey]packEntry{}}
}

// newPackID returns a new pack id: 32 lower-case hex digits, the first
// eight the Unix time in seconds (big-endian) and the rest random. Ids
// sort by when their packs were begun, so that a listing of an S3 store
// can ask for the recent ones only (S3.refresh).
func newPackID() string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return packIDTime(packClock()) + hex.EncodeToString(b)
}

// packClock is the time newPackID stamps (tests set it to stamp an old
// one).
var packClock = time.Now

// packIDTime is the part of a pack id that newPackID makes of t, the
// least id of a pack begun at t or after it.
func packIDTime(t time.Time) string {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], uint32(max(t.Unix(), 0)))
	return hex.EncodeToString(b[:])
}

type packBatch struct {
	d       *Dir
	id      string
	mu      sync.Mutex
	f       *os.File // the pack being written; nil before the first blob
	size    int64
	entries map[rawKey]packEntry
	err     error // the first failed write: Commit refuses
}

func (b *packBatch) dir() string { return filepath.Join(b.d.path, stagingDir, b.id) }

func (b *packBatch) Stage(ctx context.Context, key string, data []byte) error {
	k, err := parseKey(key)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	if _, ok := b.entries[k]; ok {
		b.mu.Unlock()
		return nil
	}
	if b.f == nil {
		if err := os.MkdirAll(b.dir(), 0o700); err != nil {
			b.mu.Unlock()
			return fmt.Errorf("stage blob %s: %w", key, err)
		}
		f, err := os.OpenFile(filepath.Join(b.dir(), b.id+packExt), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			b.mu.Unlock()
			return fmt.Errorf("stage blob %s: %w", key, err)
		}
		b.f = f
	}
	e := packEntry{key: k, off: b.size, size: int64(len(data))}
	b.entries[k] = e
	b.size += e.size
	f := b.f
	b.mu.Unlock()
	if _, err := f.WriteAt(data, e.off); err != nil {
		b.mu.Lock()
		if b.err == nil {
			b.err = err
		}
		b.mu.Unlock()
		return fmt.Errorf("stage blob %s: %w", key, err)
	}
	return nil
}

// Commit publishes the pack. Call it once every Stage has returned.
func (b *packBatch) Commit(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err != nil {
		return fmt.Errorf("commit blobs: a staged write failed: %w", b.err)
	}
	if len(b.entries) == 0 {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := b.publish(); err != nil {
		return fmt.Errorf("commit blobs: %w", err)
	}
	b.reset()
	return b.d.packs.fresh(true)
}

func (b *packBatch) publish() error {
	entries := make([]packEntry, 0, len(b.entries))
	for _, e := range b.entries {
		entries = append(entries, e)
	}
	slices.SortFunc(entries, func(x, y packEntry) int { return cmp.Compare(x.off, y.off) })
	if err := b.f.Sync(); err != nil {
		return fmt.Errorf("fsync pack: %w", err)
	}
	if err := b.f.Close(); err != nil {
		return err
	}
	b.f = nil
	idx := filepath.Join(b.dir(), b.id+idxExt)
	if err := writeSynced(idx, encodeIndex(entries)); err != nil {
		return err
	}
	packs := filepath.Join(b.d.path, packsDir)
	if err := os.Mkdir(packs, 0o700); err == nil {
		if err := atomicfile.SyncDir(b.d.path); err != nil {
			return err
		}
	} else if !errors.Is(err, fs.ErrExist) {
		return err
	}
	// The pack first, its index last: a crash between the two leaves a
	// pack nobody sees.
	if err := os.Rename(filepath.Join(b.dir(), b.id+packExt), filepath.Join(packs, b.id+packExt)); err != nil {
		return err
	}
	if err := os.Rename(idx, filepath.Join(packs, b.id+idxExt)); err != nil {
		_ = os.Remove(filepath.Join(packs, b.id+packExt))
		return err
	}
	return atomicfile.SyncDir(packs)
}

// writeSynced writes a new file and fsyncs it.
func writeSynced(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("fsync %s: %w", path, err)
	}
	return f.Close()
}

func (b *packBatch) Abort() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reset()
}

// reset forgets what was staged and removes the staging directory; the
// batch can be used again, under a new pack id. b.mu is held.
func (b *packBatch) reset() {
	if b.f != nil {
		_ = b.f.Close()
		b.f = nil
	}
	_ = os.RemoveAll(b.dir())
	b.entries, b.size, b.err = map[rawKey]packEntry{}, 0, nil
	b.id = newPackID()
}
