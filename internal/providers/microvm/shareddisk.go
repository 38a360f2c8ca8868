package microvm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"

	"stasis/internal/providers/hostkeep"
	"stasis/internal/storage/atomicfile"
)

// A guest's read-only disks (its image root, its read-only binds) are
// files of the node that booted it, and a saved machine needs those very
// bytes: its page cache holds some of their blocks. With a shared store
// (Options.Blobs) a snapshot therefore stores each disk in the store too,
// once per disk file (a one-file tree, diskEntry, whose manifest the
// snapshot's record names beside its state's), and a node that forks a
// snapshot whose disks it does not have writes them from the store into
// its own vmdisks directory, once per disk, every chunk verified. With a
// directory store nothing of this happens: a snapshot forks on its node.

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
// vm. The blob lock is held (shared).
func (p *Provider) storeDisks(ctx context.Context, vm *vmConfig) error {
	if !p.shared() {
		return nil
	}
	var err error
	if vm.Disk != "" {
		if vm.DiskManifest, err = p.storeDisk(ctx, vm.Disk, vm.DiskID); err != nil {
			return fmt.Errorf("store the image's block file %s: %w", vm.Disk, err)
		}
	}
	for i := range vm.Binds {
		b := &vm.Binds[i]
		if b.Manifest, err = p.storeDisk(ctx, b.Disk, b.DiskID); err != nil {
			return fmt.Errorf("store the block image %s of %s: %w", b.Disk, b.Source, err)
		}
	}
	return nil
}

// storeDisk stores the disk file at path, whose identity is id, as a
// one-file tree, and returns its manifest; a disk stored before (its
// record beside it names this store, this file, and a manifest the store
// has) is not read again.
func (p *Provider) storeDisk(ctx context.Context, path, id string) (string, error) {
	rec := path + ".stored.json"
	url := p.o.Blobs
	if s, err := hostkeep.ReadJSON[storedDisk](rec); err == nil && s.DiskID == id && s.Store == url {
		if ok, err := p.blobs.Has(ctx, s.Manifest); err == nil && ok {
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
// linked into place (a concurrent fork's copy, linked first, is kept).
func (p *Provider) loadDisk(ctx context.Context, manifest string) (string, error) {
	dir := filepath.Join(p.o.Home, "vmdisks")
	path := filepath.Join(dir, manifest+".img")
	if _, err := os.Stat(path); err == nil {
		return path, nil
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
	return path, nil
}

// liveManifests are the manifests a collection of the store keeps
// besides the snapshots' own (hostkeep.Snapshots.Bases): the sandboxes'
// incremental bases, and the read-only disks of every snapshot there is
// (set only in a shared store, whose snapshots are in its records).
func (p *Provider) liveManifests() ([]string, error) {
	live, err := p.sbs.Manifests()
	if err != nil || p.snaps.Shared == nil {
		return live, err
	}
	names, err := p.snaps.Shared.ListRecords(context.Background(), "snapshots/"+Name+"/")
	if err != nil {
		return nil, err
	}
	for _, n := range names {
		id, ok := strings.CutSuffix(path.Base(n), ".json")
		if !ok {
			continue
		}
		if s, err := p.snaps.Read("gc", id); err == nil {
			live = append(live, s.VM.diskManifests()...)
		}
	}
	return live, nil
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
