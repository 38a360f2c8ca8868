// Package fileop owns the file operations the in-sandbox stasis binary runs
// for a provider inside a sandbox whose root is an image: read a file,
// write one, pack a directory as a tar stream and unpack one into a
// directory. An image need not have cat, sh or tar, and the ones it has
// are its own; these run the same everywhere, as whichever user the exec
// made them (the agent, for a local sandbox's files).
//
// Unpacking never leaves its directory: every path is resolved through an
// os.Root, so neither "..", an absolute name, nor a link (one in the
// archive or one already on disk) leads out of it. Owners are not kept;
// device nodes and fifos are refused; modes keep their permission bits
// only. Packing records links as links and never follows them.
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
		err = write(rest[0], fs.FileMode(mode).Perm(), stdin)
	case op == OpPack && len(rest) == 1:
		err = Pack(rest[0], stdout)
	case op == OpUnpack && len(rest) == 1:
		err = Unpack(rest[0], stdin)
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

func write(name string, mode fs.FileMode, r io.Reader) error {
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(name, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Pack writes dir as a tar stream: directories, regular files and symbolic
// links (as links), names relative to dir ("./" first). Other kinds of
// file are left out.
func Pack(dir string, w io.Writer) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	tw := tar.NewWriter(w)
	err = fs.WalkDir(root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		switch t := fi.Mode().Type(); {
		case t == fs.ModeSymlink:
			if link, err = root.Readlink(p); err != nil {
				return err
			}
		case t != 0 && t != fs.ModeDir:
			return nil // a device, fifo or socket: not packed
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		h.Name = "./" + p
		if p == "." {
			h.Name = "./"
		} else if fi.IsDir() {
			h.Name += "/"
		}
		h.Uid, h.Gid, h.Uname, h.Gname = 0, 0, "", ""
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if !fi.Mode().IsRegular() {
			return nil
		}
		f, err := root.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
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

// Unpack extracts a tar stream into dir (made if missing) without leaving
// it: directories, regular files, symbolic and hard links. A name that
// would leave dir, a link that would be followed out of it, a device node
// or fifo fails the unpack, naming the entry.
func Unpack(dir string, r io.Reader) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("the tar stream: %w", err)
		}
		name, err := clean(h.Name)
		if err != nil {
			return err
		}
		if err := unpackOne(root, name, h, tr); err != nil {
			return fmt.Errorf("%s: %w", h.Name, err)
		}
	}
}

// clean turns an archive's name into a relative, slash-free-at-ends path
// inside the directory ("." for the directory itself).
func clean(name string) (string, error) {
	if strings.HasPrefix(name, "/") {
		return "", fmt.Errorf("%s: an absolute name in the archive", name)
	}
	c := path.Clean(name)
	if c == ".." || strings.HasPrefix(c, "../") {
		return "", fmt.Errorf("%s: a name that leaves the directory", name)
	}
	return c, nil
}

func unpackOne(root *os.Root, name string, h *tar.Header, r io.Reader) error {
	perm := fs.FileMode(h.Mode).Perm()
	if name != "." {
		if err := root.MkdirAll(path.Dir(name), 0o755); err != nil {
			return err
		}
	}
	switch h.Typeflag {
	case tar.TypeDir:
		if name == "." {
			return nil
		}
		err := root.Mkdir(name, perm|0o700)
		if errors.Is(err, fs.ErrExist) {
			if fi, serr := root.Lstat(name); serr == nil && fi.IsDir() {
				err = nil
			}
		}
		if err != nil {
			return err
		}
		return root.Chmod(name, perm)
	case tar.TypeReg:
		if err := removeNonDir(root, name); err != nil {
			return err
		}
		f, err := root.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, perm)
		if err != nil {
			return err
		}
		if _, err := io.Copy(f, r); err != nil {
			f.Close()
			return err
		}
		if err := f.Chmod(perm); err != nil {
			f.Close()
			return err
		}
		return f.Close()
	case tar.TypeSymlink:
		if err := removeNonDir(root, name); err != nil {
			return err
		}
		return root.Symlink(h.Linkname, name)
	case tar.TypeLink:
		target, err := clean(h.Linkname)
		if err != nil {
			return err
		}
		if err := removeNonDir(root, name); err != nil {
			return err
		}
		return root.Link(target, name)
	case tar.TypeXGlobalHeader:
		return nil
	}
	return fmt.Errorf("entry type %q: only directories, regular files and links are unpacked", string(h.Typeflag))
}

// removeNonDir removes what is at name unless it is missing or a
// directory (which the create then fails on, as tar does).
func removeNonDir(root *os.Root, name string) error {
	fi, err := root.Lstat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil || fi.IsDir() {
		return err
	}
	return root.Remove(name)
}
