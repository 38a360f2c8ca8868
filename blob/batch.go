package blob

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"stasis/atomicfile"
	"sync"
	"time"
)

// stagingDir holds the batches being written; it is never a fan-out
// directory, so Get, Has and Walk never see what is in it, and NewDir
// clears what a crash left there.
const stagingDir = ".staging"

// staleStaging is the age past which a staging batch is a crash's leftover.
const staleStaging = time.Hour

var _ Batcher = (*Dir)(nil)

// NewBatch starts a batch. Staged blobs are written without fsync to a
// private staging directory; Commit makes them durable with one atomicfile.SyncFS(2),
// renames them into their fan-out directories, and makes the renames
// durable with a second syncfs: two flushes of the file system instead of
// two per blob.
func (d *Dir) NewBatch() Batch {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return &dirBatch{d: d, dir: filepath.Join(d.path, stagingDir, hex.EncodeToString(b)), staged: map[string]int{}}
}

type dirBatch struct {
	d      *Dir
	dir    string
	mu     sync.Mutex
	staged map[string]int // key → size
	made   bool
}

func (b *dirBatch) Stage(ctx context.Context, key string, data []byte) error {
	if err := CheckKey(key); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	if _, ok := b.staged[key]; ok {
		b.mu.Unlock()
		return nil
	}
	b.staged[key] = len(data)
	if !b.made {
		if err := os.MkdirAll(b.dir, 0o700); err != nil {
			delete(b.staged, key)
			b.mu.Unlock()
			return fmt.Errorf("stage blob %s: %w", key, err)
		}
		b.made = true
	}
	b.mu.Unlock()
	if err := os.WriteFile(filepath.Join(b.dir, key), data, 0o600); err != nil {
		return fmt.Errorf("stage blob %s: %w", key, err)
	}
	return nil
}

func (b *dirBatch) Commit(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.staged) == 0 {
		return nil
	}
	if err := atomicfile.SyncFS(b.d.path); err != nil {
		return fmt.Errorf("commit blobs: %w", err)
	}
	fanout := map[string]bool{} // fan-out directories known to exist
	for key, size := range b.staged {
		if err := ctx.Err(); err != nil {
			return err
		}
		p := b.d.file(key)
		if fi, err := os.Lstat(p); err == nil && fi.Mode().IsRegular() && fi.Size() == int64(size) {
			continue
		}
		if dir := filepath.Dir(p); !fanout[dir] {
			if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
				return fmt.Errorf("commit blob %s: %w", key, err)
			}
			fanout[dir] = true
		}
		if err := os.Rename(filepath.Join(b.dir, key), p); err != nil {
			return fmt.Errorf("commit blob %s: %w", key, err)
		}
	}
	if err := atomicfile.SyncFS(b.d.path); err != nil {
		return fmt.Errorf("commit blobs: %w", err)
	}
	b.staged = map[string]int{}
	_ = os.RemoveAll(b.dir)
	b.made = false
	return nil
}

func (b *dirBatch) Abort() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.staged = map[string]int{}
	if b.made {
		_ = os.RemoveAll(b.dir)
		b.made = false
	}
}
