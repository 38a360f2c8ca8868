package blob

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"
)

// PackFiler is implemented by stores that take a file someone else wrote
// as a pack: the bytes are written once, by their producer, straight into
// the store (the microVM provider has QEMU migrate into it), and the
// caller then says which stretches of the file are blobs.
type PackFiler interface {
	NewPackFile() (PackFile, error)
}

// PackFile is a file being written in place as a pack. Its producer
// writes the content through File; the caller names each blob in it with
// Keep and each stretch it does not need with Drop (from any number of
// goroutines, while the producer is still writing if it likes), may add
// blobs after the content with Append, and makes
// the kept blobs durable and visible with Commit, or forgets it all with
// Abort.
type PackFile interface {
	// File is the file to write the content into (open for reading and
	// writing, at offset 0).
	File() *os.File
	// Keep names the bytes at [off, off+size) as the blob key, and starts
	// writing them back to disk. A key kept twice is kept once, where it
	// was first kept; the second stretch is dropped.
	Keep(key string, off, size int64) error
	// Drop releases, at Commit, the whole file-system blocks inside [off,
	// off+size) (adjacent dropped stretches taken as one): bytes no blob
	// needs (a blob stored before, say) then take no space, and most are
	// never written to disk.
	Drop(off, size int64) error
	// Append writes data after everything in the file and keeps it as the
	// blob key.
	Append(key string, data []byte) error
	// Commit makes the kept blobs durable and visible, as a batch's
	// Commit does. Call it once every other call has returned.
	Commit(ctx context.Context) error
	// Abort forgets the file; it is a no-op after Commit.
	Abort()
}

var _ PackFiler = (*Dir)(nil)

// NewPackFile creates an empty pack file in the store's staging directory.
func (d *Dir) NewPackFile() (PackFile, error) {
	b := &packBatch{d: d, id: newPackID(), entries: map[rawKey]packEntry{}}
	if err := os.MkdirAll(b.dir(), 0o700); err != nil {
		return nil, fmt.Errorf("new pack file: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(b.dir(), b.id+packExt), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		_ = os.RemoveAll(b.dir())
		return nil, fmt.Errorf("new pack file: %w", err)
	}
	b.f = f
	return &packFile{b: b}, nil
}

type packFile struct {
	b     *packBatch
	drops [][2]int64 // stretches to release, [start, end)
	end   int64      // past the last byte Append wrote; 0 before the first
	done  bool
}

func (p *packFile) File() *os.File { return p.b.f }

// blockSize is the unit Drop releases (the file system's block size).
const blockSize = 4096

func (p *packFile) Keep(key string, off, size int64) error {
	k, err := parseKey(key)
	if err != nil {
		return err
	}
	if off < 0 || size < 0 {
		return fmt.Errorf("keep blob %s: bad stretch at %d, %d bytes", key, off, size)
	}
	b := p.b
	b.mu.Lock()
	if _, ok := b.entries[k]; ok {
		b.mu.Unlock()
		return p.Drop(off, size)
	}
	b.entries[k] = packEntry{key: k, off: off, size: size}
	f := b.f
	b.mu.Unlock()
	if size == 0 {
		return nil
	}
	// Start the write-back now, so that Commit's fsync finds most of it
	// done; the kernel may refuse (it is only a head start).
	_ = unix.SyncFileRange(int(f.Fd()), off, size, unix.SYNC_FILE_RANGE_WRITE)
	return nil
}

func (p *packFile) Drop(off, size int64) error {
	if off < 0 || size <= 0 {
		return nil
	}
	// Released at Commit, before the fsync: releasing blocks the caller
	// may still have mapped would cost a TLB shootdown each, and stretches
	// that turn out to be adjacent go together, the block they share
	// included.
	p.b.mu.Lock()
	defer p.b.mu.Unlock()
	p.drops = append(p.drops, [2]int64{off, off + size})
	return nil
}

// release punches the whole blocks of the dropped stretches out of the
// file. b.mu is held.
func (p *packFile) release() error {
	slices.SortFunc(p.drops, func(x, y [2]int64) int { return cmp.Compare(x[0], y[0]) })
	fd := int(p.b.f.Fd())
	for i := 0; i < len(p.drops); {
		start, end := p.drops[i][0], p.drops[i][1]
		for i++; i < len(p.drops) && p.drops[i][0] <= end; i++ {
			end = max(end, p.drops[i][1])
		}
		start = (start + blockSize - 1) / blockSize * blockSize
		end = end / blockSize * blockSize
		if end <= start {
			continue
		}
		err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, start, end-start)
		if errors.Is(err, unix.EOPNOTSUPP) {
			return nil // the file system cannot: the bytes stay, unreferenced
		}
		if err != nil {
			return fmt.Errorf("release %d bytes of a pack: %w", end-start, err)
		}
	}
	p.drops = nil
	return nil
}

func (p *packFile) Append(key string, data []byte) error {
	k, err := parseKey(key)
	if err != nil {
		return err
	}
	b := p.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.entries[k]; ok {
		return nil
	}
	if p.end == 0 {
		fi, err := b.f.Stat()
		if err != nil {
			return err
		}
		p.end = fi.Size()
	}
	if _, err := b.f.WriteAt(data, p.end); err != nil {
		return fmt.Errorf("append blob %s: %w", key, err)
	}
	b.entries[k] = packEntry{key: k, off: p.end, size: int64(len(data))}
	p.end += int64(len(data))
	return nil
}

func (p *packFile) Commit(ctx context.Context) error {
	if p.done {
		return errors.New("commit pack file: already committed or aborted")
	}
	b := p.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	// The index refuses overlaps: a caller's mistake, caught here.
	entries := make([]packEntry, 0, len(b.entries))
	for _, e := range b.entries {
		entries = append(entries, e)
	}
	slices.SortFunc(entries, func(x, y packEntry) int { return cmp.Compare(x.off, y.off) })
	for i := 1; i < len(entries); i++ {
		if entries[i].off < entries[i-1].off+entries[i-1].size {
			return fmt.Errorf("commit pack file: blobs %s and %s overlap", entries[i-1].key, entries[i].key)
		}
	}
	if len(entries) == 0 {
		p.done = true
		b.reset()
		return nil
	}
	if err := p.release(); err != nil {
		return fmt.Errorf("commit pack file: %w", err)
	}
	if err := b.publish(); err != nil {
		return fmt.Errorf("commit pack file: %w", err)
	}
	p.done = true
	b.reset()
	return b.d.packs.fresh(true)
}

func (p *packFile) Abort() {
	if p.done {
		return
	}
	p.done = true
	p.b.Abort()
}
