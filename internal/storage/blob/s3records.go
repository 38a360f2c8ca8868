package blob

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"strings"

	"github.com/minio/minio-go/v7"
)

// Records are small named documents that the S3 store keeps beside its
// blobs, under PREFIX/records/: what a provider keeps about its snapshots
// (their manifests' keys), so that every node reading the store can fork
// them. They are not blobs: a record is replaced by a later put of its
// name, and nothing verifies it by a hash.

const recordsDir = "records/"

var recordName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9][A-Za-z0-9._-]{0,127}){0,3}$`)

func checkRecordName(name string) error {
	if !recordName.MatchString(name) || strings.Contains(name, "..") {
		return fmt.Errorf("record name %q: use up to four /-separated parts of letters, digits, '.', '_' and '-'", name)
	}
	return nil
}

// PutRecord stores data as record name, replacing what was there.
func (s *S3) PutRecord(ctx context.Context, name string, data []byte) error {
	if err := checkRecordName(name); err != nil {
		return err
	}
	if len(data) > maxIndex {
		return fmt.Errorf("record %s: %d bytes, over %d", name, len(data), maxIndex)
	}
	if err := s.upload(ctx, recordsDir+name, bytes.NewReader(data), int64(len(data))); err != nil {
		return fmt.Errorf("put %s: %w", s.loc.object(recordsDir+name), err)
	}
	return nil
}

// GetRecord returns record name, or an error wrapping fs.ErrNotExist.
func (s *S3) GetRecord(ctx context.Context, name string) ([]byte, error) {
	if err := checkRecordName(name); err != nil {
		return nil, err
	}
	b, err := s.fetchSmall(ctx, recordsDir+name)
	if errors.Is(err, errNoObject) {
		return nil, fmt.Errorf("%w: %w", fs.ErrNotExist, err)
	}
	return b, err
}

// DeleteRecord removes record name; removing one that is not there is
// not an error.
func (s *S3) DeleteRecord(ctx context.Context, name string) error {
	if err := checkRecordName(name); err != nil {
		return err
	}
	return s.remove(ctx, recordsDir+name)
}

// ListRecords returns the names of the records under dir (a name prefix
// ending in /), in lexical order.
func (s *S3) ListRecords(ctx context.Context, dir string) ([]string, error) {
	if dir != "" && (!strings.HasSuffix(dir, "/") || checkRecordName(strings.TrimSuffix(dir, "/")) != nil) {
		return nil, fmt.Errorf("record directory %q: a record name followed by /", dir)
	}
	base := s.loc.prefix + recordsDir
	var out []string
	for obj := range s.client.ListObjects(ctx, s.loc.bucket, minio.ListObjectsOptions{Prefix: base + dir, Recursive: true}) {
		if obj.Err != nil {
			return nil, fmt.Errorf("list %s: %w", s.loc.object(recordsDir+dir), obj.Err)
		}
		out = append(out, strings.TrimPrefix(obj.Key, base))
	}
	return out, nil
}
