package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"

	"stasis/internal/control/image"
	"stasis/internal/flock"
)

// Root file system kinds of a guest's block image.
const (
	FSErofs = "erofs"
	FSExt4  = "ext4"
)

// RootFS is the kind of block image a guest's image root is made into:
// erofs (mkfs.erofs from Debian's erofs-utils), chosen over ext4 for its
// build time and size (BENCHMARKS.md, "MicroVM images").
var RootFS = FSErofs

// rootImageName is the block image's file name in the image's directory.
func rootImageName(fs string) string { return "rootfs." + fs }

// RootImage returns the read-only block image of an unpacked image,
// building it beside the image's root once (under the image's lock; a
// build that is interrupted leaves only a temporary file).
//
// The unpacked root's owners are shifted by the store's id base (for the
// local provider's user namespaces); the guest must see the image's own.
// So mkfs runs in a user namespace that maps the image's ids 0…65535 back
// from that base: there the files have their own owners, and mkfs records
// them.
func RootImage(ctx context.Context, im image.Image, fsKind string) (string, error) {
	dir := filepath.Dir(im.Root)
	out := filepath.Join(dir, rootImageName(fsKind))
	err := buildOnce(out, filepath.Join(dir, "rootimage.lock"), func(tmp string) error {
		if err := buildRootImage(ctx, im, fsKind, tmp); err != nil {
			return fmt.Errorf("image %s: the guest's block image: %w", im.Digest, err)
		}
		return os.Chown(tmp, 0, 0)
	})
	return out, err
}

// buildOnce makes the read-only file out with build, unless it is there:
// under the lock at lockPath (taken after a first look, and looked again
// under it), into out.tmp, which becomes mode 0444 and is renamed into
// place. An interrupted build leaves only the temporary file, removed by
// the next.
func buildOnce(out, lockPath string, build func(tmp string) error) error {
	if _, err := os.Stat(out); err == nil {
		return nil
	}
	unlock, err := flock.Lock(lockPath, true)
	if err != nil {
		return err
	}
	defer unlock()
	if _, err := os.Stat(out); err == nil {
		return nil
	}
	tmp := out + ".tmp"
	_ = os.Remove(tmp)
	if err := build(tmp); err != nil {
		_ = os.Remove(tmp)
		return err
	}
	if err := os.Chmod(tmp, 0o444); err != nil {
		return err
	}
	return os.Rename(tmp, out)
}

// fileID is a file's identity for DiskID: device, inode, size and
// modification time.
func fileID(path string) (string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return "", fmt.Errorf("%s: no inode", path)
	}
	return fmt.Sprintf("%d:%d:%d:%d", st.Dev, st.Ino, fi.Size(), fi.ModTime().UnixNano()), nil
}

func buildRootImage(ctx context.Context, im image.Image, fsKind, out string) error {
	f, err := os.OpenFile(out, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	src, dst := im.Root, out
	var args []string
	switch fsKind {
	case FSErofs:
		mkfs, err := exec.LookPath("mkfs.erofs")
		if err != nil {
			return errors.New("mkfs.erofs is missing: install it with `apt-get install erofs-utils` (make installs it)")
		}
		// Every file keeps its own mtime; extended
		// attributes kept, none left out unread (-x1).
		args = []string{mkfs, "--quiet", "--preserve-mtime", "-x1", dst, src}
	case FSExt4:
		mkfs, err := exec.LookPath("mkfs.ext4")
		if err != nil {
			return errors.New("mkfs.ext4 is missing: install it with `apt-get install e2fsprogs`")
		}
		// Room for the files, their metadata and a margin; no journal
		// (the guest mounts it read-only).
		size := im.Bytes + int64(im.Files+im.Dirs+im.Links)*4096 + 64<<20
		size += size / 5
		if err := f.Truncate(size); err != nil {
			return err
		}
		args = []string{mkfs, "-q", "-F", "-O", "^has_journal", "-E", "root_owner=0:0", "-N", fmt.Sprint(im.Files + im.Dirs + im.Links + 1024), "-d", src, dst}
	default:
		return fmt.Errorf("root file system %q: use %s or %s", fsKind, FSErofs, FSExt4)
	}
	// The image's ids 0…65535 are themselves again; the host's root is
	// mapped too (as 65536), so that the namespace's root may pass the
	// state directory's private parents and write the output.
	idmap := []syscall.SysProcIDMap{{ContainerID: 0, HostID: im.IDBase, Size: image.IDRange}, {ContainerID: image.IDRange, HostID: 0, Size: 1}}
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWUSER, UidMappings: idmap, GidMappings: idmap,
		GidMappingsEnableSetgroups: true, Credential: &syscall.Credential{Uid: 0, Gid: 0},
	}
	b, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", args[0], err, strings.TrimSpace(string(b)))
	}
	return nil
}
