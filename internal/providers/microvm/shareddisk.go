package microvm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"stasis/internal/providers/hostkeep"
	"stasis/internal/storage/atomicfile"
	"stasis/internal/storage/blob"
)

// A guest's read-only disks (its image root, its read-only binds) are
// files of the node that booted it, and a saved machine needs those very
// bytes: its page cache holds some of their blocks. With a shared store
// (Options.Blobs) a snapshot therefore stores each disk in the store too,
// once per disk file (a one-file tree, diskEntry, whose manifest the
// snapshot's record names beside its state's, in vm and among the
// manifests it uses, hostkeep.SnapMeta.Uses, which every collection
// keeps while the snapshot lives), and a node that forks a snapshot
// whose disks it does not have writes them from the store into its own
// vmdisks directory, once per disk, every chunk verified. A sandbox
// forked from such a snapshot, or snapshotted, publishes its disks'
// manifests with its base while it is there (hostkeep.Sandboxes.Uses):
// its next snapshot names them again without storing the disks anew,
// however old their copies. With a directory store nothing of this
// happens: a snapshot forks on its node.

// diskEntry is the disk's name in its one-file tree.
const diskEntry = "disk"

// storedDisk is DISK.stored.json beside a disk file: the manifest it was
// stored as, in which store, for the file it was then.
type storedDisk struct {
	DiskID   string `json:"disk_id"`
	Store    string `json:"store"`
	Manifest string `json:"manifest"`
}

// storeDisks stores vm's read-only disks in the shared store (each only
// the first time, unless the file changed) and names their manifests in
// vm, which on the way in names those the sandbox has published as its
// base (its meta.json's). The blob lock is held (shared).
func (p *Provider) storeDisks(ctx context.Context, vm *vmConfig) error {
	if !p.shared() {
		return nil
	}
	var err error
	if vm.Disk != "" {
		if vm.DiskManifest, err = p.storeDisk(ctx, vm.Disk, vm.DiskID, vm.DiskManifest); err != nil {
			return fmt.Errorf("store the image's block file %s: %w", vm.Disk, err)
		}
	}
	for i := range vm.Binds {
		b := &vm.Binds[i]
		if b.Manifest, err = p.storeDisk(ctx, b.Disk, b.DiskID, b.Manifest); err != nil {
			return fmt.Errorf("store the block image %s of %s: %w", b.Disk, b.Source, err)
		}
	}
	return nil
}

// storeDisk stores the disk file at path, whose identity is id, as a
// one-file tree, and returns its manifest. A disk stored before (its
// record beside it names this store, this file, and a manifest) is not
// read again when the store has that manifest and its chunks: copies of
// any age when it is pinned (the sandbox's published base names it, so
// that every collection keeps it), else recent ones only (a collection
// elsewhere may be deleting older ones, which nothing marks).
func (p *Provider) storeDisk(ctx context.Context, path, id, pinned string) (string, error) {
	rec := path + ".stored.json"
	url := p.o.Blobs
	if s, err := hostkeep.ReadJSON[storedDisk](rec); err == nil && s.DiskID == id && s.Store == url {
		if ok, err := p.stored(ctx, s.Manifest, s.Manifest == pinned); err == nil && ok {
			return s.Manifest, nil
		}
	}
	if got, err := fileID(path); err != nil {
		return "", err
	} else if got != id {
		return "", fmt.Errorf("the file was built again since the guest booted")
	}
	// The tree is a directory beside the disk holding a hard link to it.
	tmp, err := os.MkdirTemp(filepath.Dir(path), ".store-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	if err := os.Link(path, filepath.Join(tmp, diskEntry)); err != nil {
		return "", err
	}
	manifest, _, err := p.snaps.CAS.Snapshot(ctx, tmp, "")
	if err != nil {
		return "", err
	}
	if err := atomicfile.WriteJSON(rec, storedDisk{DiskID: id, Store: url, Manifest: manifest}, 0o600); err != nil {
		return "", err
	}
	return manifest, nil
}

// stored reports whether the store has manifest and every chunk of it:
// copies of any age when pinned (blob.AnyHaver), else ones the store's
// Has reports (recent ones).
func (p *Provider) stored(ctx context.Context, manifest string, pinned bool) (bool, error) {
	has := p.blobs.Has
	if a, ok := p.blobs.(blob.AnyHaver); ok && pinned {
		has = a.HasAny
	}
	if ok, err := has(ctx, manifest); err != nil || !ok {
		return false, err
	}
	keys, err := p.snaps.CAS.Chunks(ctx, manifest)
	if err != nil {
		return false, err
	}
	for _, k := range keys {
		if ok, err := has(ctx, k); err != nil || !ok {
			return false, err
		}
	}
	return true, nil
}

// disksHere points vm's read-only disks at files of this node: the very
// files the guest had when they are here, else this node's copies of
// them written from the shared store (see loadDisk). A disk that is not
// here and was not stored is left as it is (Fork refuses it).
func (p *Provider) disksHere(ctx context.Context, snap string, vm *vmConfig) error {
	here := func(disk, id, manifest *string) error {
		if *disk == "" || *manifest == "" {
			return nil
		}
		if got, err := fileID(*disk); err == nil && got == *id {
			return nil
		}
		path, err := p.loadDisk(ctx, *manifest)
		if err != nil {
			return fmt.Errorf("fork snapshot %s: its guest's read-only disk %s is not on this node, and writing it from the store failed: %w", snap, *disk, err)
		}
		if *id, err = fileID(path); err != nil {
			return err
		}
		*disk = path
		return nil
	}
	if err := here(&vm.Disk, &vm.DiskID, &vm.DiskManifest); err != nil {
		return err
	}
	for i := range vm.Binds {
		b := &vm.Binds[i]
		if err := here(&b.Disk, &b.DiskID, &b.Manifest); err != nil {
			return err
		}
	}
	return nil
}

// loadDisk returns this node's copy of a disk stored as manifest
// (Home/vmdisks/MANIFEST.img), writing it from the store first when it
// is not there: into a temporary file, made durable and read-only, then
// linked into place (another process's copy, linked first, is kept); the
// forks of this process write it once. Its record beside it
// (.stored.json) says it is stored as manifest, so that a snapshot of a
// fork that has it pinned does not store it again (storeDisk).
func (p *Provider) loadDisk(ctx context.Context, manifest string) (string, error) {
	p.diskMu.Lock()
	defer p.diskMu.Unlock()
	dir := filepath.Join(p.o.Home, "vmdisks")
	path := filepath.Join(dir, manifest+".img")
	if _, err := os.Stat(path); err == nil {
		return path, p.recordLoaded(path, manifest)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	f, err := os.CreateTemp(dir, ".load-")
	if err != nil {
		return "", err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	w := bufio.NewWriterSize(f, 1<<20)
	if err := p.snaps.CAS.CatFile(ctx, manifest, diskEntry, w); err != nil {
		return "", err
	}
	if err := w.Flush(); err != nil {
		return "", err
	}
	if err := f.Sync(); err != nil {
		return "", err
	}
	if err := f.Chmod(0o444); err != nil {
		return "", err
	}
	if err := os.Link(f.Name(), path); err != nil && !errors.Is(err, os.ErrExist) {
		return "", err
	}
	if err := atomicfile.SyncDir(dir); err != nil {
		return "", err
	}
	return path, p.recordLoaded(path, manifest)
}

// recordLoaded writes the record of disk copy path, written from
// manifest, unless it has one.
func (p *Provider) recordLoaded(path, manifest string) error {
	id, err := fileID(path)
	if err != nil {
		return err
	}
	rec := storedDisk{DiskID: id, Store: p.o.Blobs, Manifest: manifest}
	if old, err := hostkeep.ReadJSON[storedDisk](path + ".stored.json"); err == nil && old == rec {
		return nil
	}
	return atomicfile.WriteJSON(path+".stored.json", rec, 0o600)
}

// diskManifests are the manifests of vm's stored read-only disks.
func (vm vmConfig) diskManifests() []string {
	var out []string
	if vm.DiskManifest != "" {
		out = append(out, vm.DiskManifest)
	}
	for _, b := range vm.Binds {
		if b.Manifest != "" {
			out = append(out, b.Manifest)
		}
	}
	return out
}
