package blob

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"stasis/atomicfile"
)

// Dir is a Store in a directory on the local file system. A blob with key
// abcdef... is the file DIR/ab/abcdef...; the 256 fan-out subdirectories
// keep directories small. Blobs are written with atomicfile (temporary
// file in the fan-out directory, fsync, rename, fsync of the directory), so
// a key names either nothing or the whole blob, and the temporary files,
// whose names are never keys, are invisible to Get, Has and Walk.
type Dir struct {
	path string
}

var _ Store = (*Dir)(nil)

// NewDir opens the directory store at path, creating the directory (mode
// 0700) if it is missing.
func NewDir(path string) (*Dir, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("blob store %s: %w", path, err)
	}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return nil, fmt.Errorf("blob store %s: %w", abs, err)
	}
	fi, err := os.Stat(abs)
	if err != nil {
		return nil, fmt.Errorf("blob store %s: %w", abs, err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("blob store %s: not a directory; give the path of a directory (it is created when missing)", abs)
	}
	// Batches a crash cut short were never committed, so nothing refers to
	// them. Only old ones go: another process may be staging right now.
	if ents, err := os.ReadDir(filepath.Join(abs, stagingDir)); err == nil {
		for _, e := range ents {
			if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > staleStaging {
				_ = os.RemoveAll(filepath.Join(abs, stagingDir, e.Name()))
			}
		}
	}
	return &Dir{path: abs}, nil
}

// Path is the store's directory.
func (d *Dir) Path() string { return d.path }

// file is the path of key's blob; key must be valid.
func (d *Dir) file(key string) string { return filepath.Join(d.path, key[:2], key) }

// Put stores data under key durably. A blob already stored with the same
// length is left as it is; one of another length (a damaged blob) is
// replaced.
func (d *Dir) Put(ctx context.Context, key string, data []byte) error {
	if err := CheckKey(key); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	p := d.file(key)
	if fi, err := os.Lstat(p); err == nil && fi.Mode().IsRegular() && fi.Size() == int64(len(data)) {
		return nil
	}
	sub := filepath.Dir(p)
	if err := os.Mkdir(sub, 0o700); err == nil {
		// A new fan-out directory: make its entry in the store's directory
		// durable before a blob in it is called durable.
		if err := atomicfile.SyncDir(d.path); err != nil {
			return fmt.Errorf("put blob %s: %w", key, err)
		}
	} else if !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("put blob %s: %w", key, err)
	}
	if err := atomicfile.Write(p, data, 0o600); err != nil {
		return fmt.Errorf("put blob %s: %w", key, err)
	}
	return nil
}

// Get returns key's blob.
func (d *Dir) Get(ctx context.Context, key string) ([]byte, error) {
	if err := CheckKey(key); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b, err := os.ReadFile(d.file(key))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("blob %s in %s: %w", key, d.path, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("get blob %s: %w", key, err)
	}
	return b, nil
}

// Has reports whether key is stored.
func (d *Dir) Has(ctx context.Context, key string) (bool, error) {
	if err := CheckKey(key); err != nil {
		return false, err
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	fi, err := os.Lstat(d.file(key))
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("blob %s: %w", key, err)
	}
	return fi.Mode().IsRegular(), nil
}

// Delete removes key's blob, durably; a key not stored is not an error.
func (d *Dir) Delete(ctx context.Context, key string) error {
	if err := CheckKey(key); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	p := d.file(key)
	err := os.Remove(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete blob %s: %w", key, err)
	}
	if err := atomicfile.SyncDir(filepath.Dir(p)); err != nil {
		return fmt.Errorf("delete blob %s: %w", key, err)
	}
	return nil
}

// Walk calls fn for every stored blob, fan-out directory by fan-out
// directory in lexical order. Files that are not blobs (temporary files of
// a write in progress or cut short by a crash) are passed over.
func (d *Dir) Walk(ctx context.Context, fn func(key string, size int64) error) error {
	subs, err := os.ReadDir(d.path)
	if err != nil {
		return fmt.Errorf("walk blob store %s: %w", d.path, err)
	}
	for _, s := range subs {
		if !s.IsDir() || !isFanout(s.Name()) {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		dir := filepath.Join(d.path, s.Name())
		ents, err := os.ReadDir(dir)
		if err != nil {
			return fmt.Errorf("walk blob store %s: %w", d.path, err)
		}
		for _, e := range ents {
			name := e.Name()
			if !e.Type().IsRegular() || !ValidKey(name) || name[:2] != s.Name() {
				continue
			}
			fi, err := e.Info()
			if errors.Is(err, fs.ErrNotExist) {
				continue // deleted since the directory was read
			}
			if err != nil {
				return fmt.Errorf("walk blob store %s: %w", d.path, err)
			}
			if err := fn(name, fi.Size()); err != nil {
				return err
			}
		}
	}
	return nil
}

func isFanout(name string) bool {
	return len(name) == 2 && lowerHex(name)
}
