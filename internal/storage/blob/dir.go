package blob

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"stasis/internal/flock"
	"stasis/internal/storage/atomicfile"
)

// Dir is a Store in a directory on the local file system. Blobs live in
// two places, and every method looks in both:
//   - packs (see pack.go): a batch is committed as one pack file and its
//     index in DIR/packs, one file created per batch however many blobs
//     it holds;
//   - loose files: Put writes a blob with key abcdef... as the file
//     DIR/ab/abcdef... (the 256 fan-out subdirectories keep directories
//     small) with atomicfile (temporary file in the fan-out directory,
//     fsync, rename, fsync of the directory), so a key names either nothing
//     or the whole blob, and the temporary files, whose names are never
//     keys, are invisible to Get, Has and Walk. Stores written before packs
//     existed are all loose files.
//
// Several processes may use one directory at once: each notices what the
// others committed or deleted by the packs directory's mtime.
type Dir struct {
	path  string
	packs *packSet
	// delMu serialises this process's rewriting of packs' dead lists
	// (the packs.lock flock does so across processes).
	delMu sync.Mutex
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
	d := &Dir{path: abs, packs: newPackSet(filepath.Join(abs, packsDir))}
	d.clearPacks()
	if err := d.packs.fresh(true); err != nil {
		return nil, fmt.Errorf("blob store %s: %w", abs, err)
	}
	return d, nil
}

// clearPacks removes what a crash or a finished rewrite left in the packs
// directory: packs without an index once old (a commit in another process
// renames the pack a moment before its index), dead lists superseded by a
// newer one, dead lists of packs that are gone, and old temporary dead
// lists that a crash left before their rename.
func (d *Dir) clearPacks() {
	dir := filepath.Join(d.path, packsDir)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for id, n := range packNames(ents) {
		if n.pack && !n.idx {
			if fi, err := os.Stat(filepath.Join(dir, id+packExt)); err == nil && time.Since(fi.ModTime()) > staleStaging {
				_ = os.Remove(filepath.Join(dir, id+packExt))
				n.pack = false
			}
		}
		for _, g := range n.gens {
			if g < n.gen || (!n.idx && !n.pack) {
				_ = os.Remove(filepath.Join(dir, id+deadExt+strconv.Itoa(g)))
			}
		}
	}
	// A dead list's temporary file, left by a crash before its rename.
	for _, e := range ents {
		if name := e.Name(); strings.HasPrefix(name, ".") && strings.Contains(name, deadExt) {
			if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > staleStaging {
				_ = os.Remove(filepath.Join(dir, name))
			}
		}
	}
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
	k, err := parseKey(key)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	for try := 0; try < 2; try++ {
		if err := d.packs.fresh(try > 0); err != nil {
			return nil, fmt.Errorf("get blob %s: %w", key, err)
		}
		l, ok := d.packs.lookup(k)
		if !ok {
			break
		}
		b, err := readAt(d.packPath(l.p.id), l.off, l.size)
		if errors.Is(err, fs.ErrNotExist) {
			continue // the pack went since the last scan: scan again
		}
		if err != nil {
			return nil, fmt.Errorf("get blob %s: %w", key, err)
		}
		return b, nil
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

func (d *Dir) packPath(id string) string { return filepath.Join(d.path, packsDir, id+packExt) }

// Has reports whether key is stored.
func (d *Dir) Has(ctx context.Context, key string) (bool, error) {
	k, err := parseKey(key)
	if err != nil {
		return false, err
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if err := d.packs.fresh(false); err != nil {
		return false, fmt.Errorf("blob %s: %w", key, err)
	}
	if _, ok := d.packs.lookup(k); ok {
		return true, nil
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

// Locate says where key's blob is: the file that holds it, and its offset
// and length there (0 and the file's size for a loose blob). It is for
// diagnostics and for tests that damage a store on purpose.
func (d *Dir) Locate(ctx context.Context, key string) (file string, off, size int64, err error) {
	k, err := parseKey(key)
	if err != nil {
		return "", 0, 0, err
	}
	if err := d.packs.fresh(true); err != nil {
		return "", 0, 0, err
	}
	if l, ok := d.packs.lookup(k); ok {
		return d.packPath(l.p.id), l.off, l.size, nil
	}
	fi, err := os.Lstat(d.file(key))
	if errors.Is(err, fs.ErrNotExist) {
		return "", 0, 0, fmt.Errorf("blob %s in %s: %w", key, d.path, ErrNotFound)
	}
	if err != nil {
		return "", 0, 0, err
	}
	return d.file(key), 0, fi.Size(), nil
}

// Delete removes key's blob, durably; a key not stored is not an error.
func (d *Dir) Delete(ctx context.Context, key string) error {
	return d.DeleteKeys(ctx, []string{key})
}

var _ BulkDeleter = (*Dir)(nil)

// DeleteKeys removes every key's blob, durably; keys not stored are not an
// error. Loose blobs are removed; a pack left with no live blob is
// removed, one more than half dead is rewritten with its live blobs only,
// and any other gets a new dead list: each pack is rewritten once however
// many of its blobs go. Every key is checked before anything is deleted.
func (d *Dir) DeleteKeys(ctx context.Context, keys []string) error {
	raw, err := parseKeys(ctx, keys)
	if err != nil {
		return err
	}
	// Loose files.
	dirs := map[string]bool{}
	for _, key := range keys {
		p := d.file(key)
		err := os.Remove(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("delete blob %s: %w", key, err)
		}
		dirs[filepath.Dir(p)] = true
	}
	for dir := range dirs {
		if err := atomicfile.SyncDir(dir); err != nil {
			return fmt.Errorf("delete blobs: %w", err)
		}
	}
	// Packs.
	if _, err := os.Stat(filepath.Join(d.path, packsDir)); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	d.delMu.Lock()
	defer d.delMu.Unlock()
	unlock, err := flock.Lock(filepath.Join(d.path, packLock), true)
	if err != nil {
		return fmt.Errorf("delete blobs: %w", err)
	}
	defer unlock()
	if err := d.packs.fresh(true); err != nil {
		return fmt.Errorf("delete blobs: %w", err)
	}
	doomed := map[*pack][]rawKey{}
	d.packs.mu.RLock()
	for _, k := range raw {
		for l := d.packs.keys[k]; l != nil; l = l.next {
			doomed[l.p] = append(doomed[l.p], k)
		}
	}
	d.packs.mu.RUnlock()
	for p, ks := range doomed {
		if err := d.retire(ctx, p, ks); err != nil {
			return fmt.Errorf("delete blobs: pack %s: %w", p.id, err)
		}
	}
	if err := atomicfile.SyncDir(filepath.Join(d.path, packsDir)); err != nil {
		return fmt.Errorf("delete blobs: %w", err)
	}
	return d.packs.fresh(true)
}

// retire marks ks dead in p: it removes p when nothing in it lives on,
// rewrites it with its live blobs when more than half its bytes are dead,
// and otherwise writes its next dead list. The packs lock is held.
func (d *Dir) retire(ctx context.Context, p *pack, ks []rawKey) error {
	dead := map[rawKey]bool{}
	for k := range p.dead {
		dead[k] = true
	}
	for _, k := range ks {
		dead[k] = true
	}
	var live []packEntry
	var deadB int64
	for _, e := range p.entries {
		if dead[e.key] {
			deadB += e.size
		} else {
			live = append(live, e)
		}
	}
	dir := filepath.Join(d.path, packsDir)
	writeDead := func() error {
		list := make([]rawKey, 0, len(dead))
		for k := range dead {
			list = append(list, k)
		}
		// Whole or not at all: another process's scan may read it at once.
		next := filepath.Join(dir, p.id+deadExt+strconv.Itoa(p.gen+1))
		if err := atomicfile.Write(next, encodeDead(list), 0o600); err != nil {
			return err
		}
		if p.gen > 0 {
			_ = os.Remove(filepath.Join(dir, p.id+deadExt+strconv.Itoa(p.gen)))
		}
		return nil
	}
	if len(live) > 0 && 2*deadB <= p.bytes {
		return writeDead()
	}
	if len(live) > 0 {
		// Copy the live blobs into a new pack before the old one goes. A
		// pack that cannot be read whole keeps its place (with a dead
		// list): the blobs it holds fail their readers' checks, and the
		// rest of the store is collected as usual.
		if err := d.rewrite(ctx, p, live); err != nil {
			slog.Warn("a pack more than half dead could not be rewritten; its dead blobs are listed instead", "pack", d.packPath(p.id), "err", err)
			return writeDead()
		}
	}
	// The index first: without it the pack is invisible, whatever is
	// left of it after a crash.
	if err := os.Remove(filepath.Join(dir, p.id+idxExt)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := atomicfile.SyncDir(dir); err != nil {
		return err
	}
	_ = os.Remove(filepath.Join(dir, p.id+packExt))
	if p.gen > 0 {
		_ = os.Remove(filepath.Join(dir, p.id+deadExt+strconv.Itoa(p.gen)))
	}
	return nil
}

// rewrite copies p's live blobs into a new pack.
func (d *Dir) rewrite(ctx context.Context, p *pack, live []packEntry) error {
	f, err := os.Open(d.packPath(p.id))
	if err != nil {
		return err
	}
	defer f.Close()
	b := d.NewBatch()
	for _, e := range live {
		data := make([]byte, e.size)
		n, err := f.ReadAt(data, e.off)
		if err == io.EOF && int64(n) < e.size {
			err = fmt.Errorf("blob %s: the pack holds %d of its %d bytes", e.key, n, e.size)
		}
		if err == nil {
			err = b.Stage(ctx, e.key.String(), data)
		}
		if err != nil {
			b.Abort()
			return err
		}
	}
	if err := b.Commit(ctx); err != nil {
		b.Abort()
		return err
	}
	return nil
}

// Walk calls fn for every stored blob once: loose blobs fan-out directory
// by fan-out directory in lexical order, then packed ones. Files that are
// not blobs (temporary files of a write in progress or cut short by a
// crash) are passed over.
func (d *Dir) Walk(ctx context.Context, fn func(key string, size int64) error) error {
	subs, err := os.ReadDir(d.path)
	if err != nil {
		return fmt.Errorf("walk blob store %s: %w", d.path, err)
	}
	loose := map[string]bool{}
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
			loose[name] = true
			if err := fn(name, fi.Size()); err != nil {
				return err
			}
		}
	}
	if err := d.packs.fresh(true); err != nil {
		return fmt.Errorf("walk blob store %s: %w", d.path, err)
	}
	type kv struct {
		key  string
		size int64
	}
	d.packs.mu.RLock()
	packed := make([]kv, 0, len(d.packs.keys))
	for k, l := range d.packs.keys {
		if s := k.String(); !loose[s] {
			packed = append(packed, kv{s, l.size})
		}
	}
	d.packs.mu.RUnlock()
	for _, b := range packed {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := fn(b.key, b.size); err != nil {
			return err
		}
	}
	return nil
}

func isFanout(name string) bool {
	return len(name) == 2 && lowerHex(name)
}
