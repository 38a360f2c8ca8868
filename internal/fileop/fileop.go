// Package fileop owns the file operations the in-sandbox stasis binary runs
// for a provider inside a sandbox whose root is an image: read a file,
// write one, pack a directory as a tar stream and unpack one into a
// directory. An image need not have cat, sh or tar, and the ones it has
// are its own; these run the same everywhere, as whichever user the exec
// made them (the agent, for a local sandbox's files).
//
// Pack and Unpack are also the microVM guest agent's download and upload.
// Unpacking never leaves its directory: every path is resolved through an
// os.Root, so neither "..", an absolute name, nor a link (one in the
// archive or one already on disk) leads out of it. Owners are not kept;
// device nodes and fifos are left out. Packing records links as links and
// never follows them.
package fileop

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Arg is the first argument that selects these operations in the
// in-sandbox binary (before any command-line parsing).
const Arg = "__stasis-file"

// Ops, the argument after Arg.
const (
	OpCat    = "cat"    // cat FILE: the file on stdout
	OpWrite  = "write"  // write FILE MODE: stdin into FILE (parents made), MODE octal
	OpPack   = "pack"   // pack DIR: DIR as a tar stream on stdout
	OpUnpack = "unpack" // unpack DIR: a tar stream on stdin into DIR (made if missing)
)

// Args is the argument list (after the binary) of one operation.
func Args(op string, args ...string) []string { return append([]string{Arg, op}, args...) }

// Main runs the operation in args (starting with Arg) and returns the exit
// code: 0 done, 1 failed (the reason on stderr), 2 a usage error.
func Main(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) < 2 || args[0] != Arg {
		fmt.Fprintln(stderr, "usage:", Arg, "cat FILE | write FILE MODE | pack DIR | unpack DIR")
		return 2
	}
	op, rest := args[1], args[2:]
	var err error
	switch {
	case op == OpCat && len(rest) == 1:
		err = cat(rest[0], stdout)
	case op == OpWrite && len(rest) == 2:
		var mode uint64
		mode, err = strconv.ParseUint(rest[1], 8, 32)
		if err != nil || mode > 0o7777 {
			fmt.Fprintf(stderr, "stasis file: write: mode %q is not an octal file mode\n", rest[1])
			return 2
		}
		err = Write(rest[0], stdin, fs.FileMode(mode).Perm())
	case op == OpPack && len(rest) == 1:
		err = Pack(rest[0], stdout)
	case op == OpUnpack && len(rest) == 1:
		err = Unpack(rest[0], stdin, func(h *tar.Header) {
			fmt.Fprintf(stderr, "stasis file: unpack: %s left out (type %q)\n", h.Name, string(h.Typeflag))
		})
	default:
		fmt.Fprintf(stderr, "stasis file: %q with %d arguments: use cat FILE, write FILE MODE, pack DIR or unpack DIR\n", op, len(rest))
		return 2
	}
	if err != nil {
		fmt.Fprintln(stderr, "stasis file:", err)
		return 1
	}
	return 0
}

func cat(name string, w io.Writer) error {
	f, err := os.Open(name)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file (%v)", name, fi.Mode().Type())
	}
	_, err = io.Copy(w, f)
	return err
}

// ErrInvalid marks a Write the caller got wrong: a directory in the way,
// a path that cannot be made.
var ErrInvalid = errors.New("invalid write")

// Write writes a file atomically: a temporary file beside it, renamed over
// it, its parent directories made first. A symlink at p writes the file it
// points to.
func Write(p string, data io.Reader, mode fs.FileMode) error {
	invalid := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
	}
	target, err := followLinks(p)
	if err != nil {
		return invalid("%s: %v", p, err)
	}
	if target == "/" {
		return invalid("%s is a directory", p)
	}
	dir := filepath.Dir(target)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return invalid("%s: %v", p, err)
	}
	if fi, err := os.Lstat(target); err == nil && fi.IsDir() {
		return invalid("%s is a directory", p)
	}
	base := filepath.Base(target)
	if len(base) > 100 { // room for the suffix within NAME_MAX
		base = base[:100]
	}
	f, err := os.CreateTemp(dir, "."+base+".stasis-*")
	if err != nil {
		return invalid("%s: %v", p, err)
	}
	_, err = io.Copy(f, data)
	if err == nil {
		err = f.Chmod(mode)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), target)
	}
	if err != nil {
		_ = os.Remove(f.Name())
		return fmt.Errorf("write %s: %w", p, err)
	}
	return nil
}

// followLinks resolves symlinks in the last element of p, as open(2) would.
func followLinks(p string) (string, error) {
	for range 40 {
		fi, err := os.Lstat(p)
		if err != nil || fi.Mode()&fs.ModeSymlink == 0 {
			return p, nil
		}
		link, err := os.Readlink(p)
		if err != nil {
			return "", err
		}
		if !filepath.IsAbs(link) {
			link = filepath.Join(filepath.Dir(p), link)
		}
		p = filepath.Clean(link)
	}
	return "", syscall.ELOOP
}

// specialBits are the mode bits beyond the permissions that an unpacked
// entry keeps.
const specialBits = fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky

// Pack writes dir as a tar stream: "./" and then "./name" for everything
// under it (PAX headers, no access or change times), symbolic links as
// links, never followed, hard links kept as links. Sockets and other kinds
// tar cannot hold are left out, and so is what vanishes during the walk.
func Pack(dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	type inode struct{ dev, ino uint64 }
	seen := map[inode]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && p != dir {
				return nil // gone since the directory was listed
			}
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		name := "./"
		if rel != "." {
			name += filepath.ToSlash(rel)
		}
		fi, err := d.Info()
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return nil // a socket or another kind tar cannot hold
		}
		h.Name, h.Format = name, tar.FormatPAX
		h.AccessTime, h.ChangeTime = time.Time{}, time.Time{}
		h.Uname, h.Gname = "", ""
		if fi.IsDir() && rel != "." {
			h.Name += "/"
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && fi.Mode().IsRegular() && st.Nlink > 1 {
			key := inode{uint64(st.Dev), st.Ino}
			if first, ok := seen[key]; ok {
				h.Typeflag, h.Linkname, h.Size = tar.TypeLink, first, 0
			} else {
				seen[key] = name
			}
		}
		if h.Typeflag != tar.TypeReg {
			return tw.WriteHeader(h)
		}
		f, err := os.Open(p)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		defer f.Close()
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := io.CopyN(tw, f, h.Size); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// Unpack extracts a tar stream into dir (made if missing) through an
// os.Root, so no entry leads out of dir: not by "..", an absolute name, a
// link in the archive or one already on disk. Directories, regular files,
// symbolic and hard links are unpacked, with their permission and special
// bits and modification times (a directory's set last); owners are not
// kept. Other kinds (devices, fifos) are passed to skipped, if not nil,
// and left out.
func Unpack(dir string, r io.Reader, skipped func(h *tar.Header)) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	var dirs []dirTimes
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("bad tar stream: %w", err)
		}
		if err := unpackEntry(root, tr, h, &dirs, skipped); err != nil {
			if strings.Contains(err.Error(), "path escapes") { // os.Root's error
				return fmt.Errorf("entry %q leads out of the directory through a symlink (%v)", h.Name, err)
			}
			return fmt.Errorf("entry %q: %w", h.Name, err)
		}
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		d := dirs[i]
		if err := root.Chmod(d.name, d.mode); err != nil {
			return err
		}
		if err := root.Chtimes(d.name, d.mtime, d.mtime); err != nil {
			return err
		}
	}
	return nil
}

// entryName checks a tar entry's name (or a hard link's target) and
// returns it clean and relative to the extraction directory ("." for the
// directory itself).
func entryName(name string) (string, error) {
	if name == "" {
		return "", errors.New("empty name")
	}
	if strings.HasPrefix(name, "/") {
		return "", errors.New("absolute path")
	}
	for _, el := range strings.Split(name, "/") {
		if el == ".." {
			return "", errors.New(`".." in the path`)
		}
	}
	return path.Clean(name), nil
}

// dirTimes is a directory whose mode and time are set after every entry is
// in (an entry written into it would change its time again).
type dirTimes struct {
	name  string
	mode  fs.FileMode
	mtime time.Time
}

func unpackEntry(root *os.Root, tr *tar.Reader, h *tar.Header, dirs *[]dirTimes, skipped func(*tar.Header)) error {
	name, err := entryName(h.Name)
	if err != nil {
		return err
	}
	mode := h.FileInfo().Mode() & (fs.ModePerm | specialBits)
	if parent := path.Dir(name); parent != "." {
		if err := root.MkdirAll(parent, 0o755); err != nil {
			return err
		}
	}
	switch h.Typeflag {
	case tar.TypeDir:
		if fi, err := root.Lstat(name); err == nil && !fi.IsDir() {
			if err := root.Remove(name); err != nil {
				return err
			}
		}
		if err := root.Mkdir(name, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		*dirs = append(*dirs, dirTimes{name, mode, h.ModTime})
		return nil
	case tar.TypeReg:
		if err := replaceable(root, name); err != nil {
			return err
		}
		f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		_, err = io.Copy(f, tr)
		if err == nil {
			err = f.Chmod(mode)
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		return root.Chtimes(name, h.ModTime, h.ModTime)
	case tar.TypeSymlink:
		if err := replaceable(root, name); err != nil {
			return err
		}
		return root.Symlink(h.Linkname, name)
	case tar.TypeLink:
		target, err := entryName(h.Linkname)
		if err != nil {
			return fmt.Errorf("link target %q: %v", h.Linkname, err)
		}
		if target == name {
			return nil // a link to itself: the file is already there
		}
		if err := replaceable(root, name); err != nil {
			return err
		}
		return root.Link(target, name)
	}
	if skipped != nil {
		skipped(h)
	}
	return nil
}

// replaceable removes what is at name unless it is a directory (which
// stays, and makes the entry fail).
func replaceable(root *os.Root, name string) error {
	fi, err := root.Lstat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return errors.New("a directory is in the way")
	}
	return root.Remove(name)
}
