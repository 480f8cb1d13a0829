// openloop: an HTTP load generator for the soak (benchmarks/soak.py), compiled so that it is not the limit.
//
// Open loop (-rate): request i is due at start + i/rate, sent then on its own goroutine whatever the earlier ones
// are doing, and its latency counts from that due time: a server that stalls is charged for the requests that
// queued behind the stall (no coordinated omission). Closed loop (-concurrency): that many clients each send their
// next request when the last one is answered; it measures capacity.
//
// Bodies are the files of -bodies, sent in name order and round robin; a file named *.mp4 goes out as video/mp4
// every -video-every requests, the others (JPEG) as image/jpeg. With -unique each image request's bytes are its own:
// a JPEG comment segment holding the request's number follows the start-of-image marker, so no reply comes from
// the server's embedding cache (what a stream of distinct photos gets) and the pixels are unchanged. Connections are kept alive, as real clients do.
// Every request becomes one CSV row: due (ns from start), send delay (ns after due), latency (ns, due to the last
// byte of the reply), status (0: no reply), reply bytes, kind, the X-Cache header, error, and the server's timing
// headers (preprocess, queue, inference and total ms; empty where absent). A JSON summary goes to stdout at the end:
// offered and achieved rates (requests sent over the time it took to send them) and the generator's CPU seconds.
//
// Build: CGO_ENABLED=0 go build -o openloop tools/openloop/main.go (Go 1.19 or later, standard library only).
package main

import (
	"bufio"
	"bytes"
	"encoding/csv"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

type body struct {
	data  []byte
	ctype string
	kind  string
}

type row struct {
	due, delay, latency time.Duration
	status, size        int
	kind, cache, err    string
	timing              [len(timingHeaders)]string // the server's timing headers, as sent
}

// the server's own account of a request (milliseconds): decoding, waiting for a forward, the forward, and all of it
var timingHeaders = [...]string{"X-Preprocess-Time-Ms", "X-Queue-Time-Ms", "X-Inference-Time-Ms", "X-Total-Time-Ms"}

func loadBodies(dir string) (images, videos []body, err error) {
	names, err := filepath.Glob(filepath.Join(dir, "*"))
	if err != nil {
		return nil, nil, err
	}
	sort.Strings(names)
	for _, name := range names {
		data, err := os.ReadFile(name)
		if err != nil {
			return nil, nil, err
		}
		if strings.HasSuffix(name, ".mp4") {
			videos = append(videos, body{data, "video/mp4", "video"})
		} else {
			images = append(images, body{data, "image/jpeg", "image"})
		}
	}
	if len(images) == 0 {
		return nil, nil, fmt.Errorf("no image bodies in %s", dir)
	}
	return images, videos, nil
}

// withComment: the JPEG `data` with a comment segment (FFFE) holding `n` right after its start-of-image marker.
func withComment(data []byte, n int) []byte {
	if len(data) < 2 || data[0] != 0xFF || data[1] != 0xD8 {
		return data
	}
	text := []byte(fmt.Sprintf("openloop request %d", n))
	out := make([]byte, 0, len(data)+len(text)+4)
	out = append(out, data[:2]...)
	out = append(out, 0xFF, 0xFE, byte((len(text)+2)>>8), byte(len(text)+2))
	out = append(out, text...)
	return append(out, data[2:]...)
}

func cpuSeconds() float64 {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return -1
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}

func main() {
	url := flag.String("url", "", "where to POST, e.g. http://127.0.0.1:8000/embed?format=safetensors")
	dir := flag.String("bodies", "", "directory of request bodies (*.jpg images, *.mp4 videos)")
	rate := flag.Float64("rate", 0, "open loop: requests per second")
	concurrency := flag.Int("concurrency", 0, "closed loop: clients")
	duration := flag.Duration("duration", 20*time.Second, "how long to send")
	videoEvery := flag.Int("video-every", 0, "every Nth request is a video (0: none)")
	timeout := flag.Duration("timeout", 60*time.Second, "per request")
	out := flag.String("out", "", "CSV of every request")
	unique := flag.Bool("unique", false, "give each image request bytes of its own (a JPEG comment)")
	flag.Parse()
	if *url == "" || *dir == "" || *out == "" || (*rate > 0) == (*concurrency > 0) {
		fmt.Fprintln(os.Stderr, "need -url, -bodies, -out and one of -rate or -concurrency")
		os.Exit(2)
	}
	images, videos, err := loadBodies(*dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	pick := func(i int) body {
		if *videoEvery > 0 && len(videos) > 0 && i%*videoEvery == *videoEvery-1 {
			return videos[(i / *videoEvery)%len(videos)]
		}
		return images[i%len(images)]
	}
	client := &http.Client{Timeout: *timeout, Transport: &http.Transport{
		MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096, IdleConnTimeout: 90 * time.Second}}

	f, err := os.Create(*out)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	rows := make(chan row, 65536)
	written := make(chan struct{})
	go func() {
		b := bufio.NewWriterSize(f, 1<<20)
		w := csv.NewWriter(b) // RFC 4180: an error's quotes and commas survive any CSV reader
		w.Write([]string{"due_ns", "delay_ns", "latency_ns", "status", "bytes", "kind", "cache", "error",
			"preprocess_ms", "queue_ms", "inference_ms", "server_ms"})
		for r := range rows {
			w.Write(append([]string{fmt.Sprint(int64(r.due)), fmt.Sprint(int64(r.delay)), fmt.Sprint(int64(r.latency)),
				fmt.Sprint(r.status), fmt.Sprint(r.size), r.kind, r.cache, r.err}, r.timing[:]...))
		}
		w.Flush()
		b.Flush()
		f.Close()
		close(written)
	}()

	start := time.Now()
	var sent int64
	var statusMu sync.Mutex
	statuses := map[string]int{}
	send := func(i int, due time.Duration) {
		b := pick(i)
		r := row{due: due, delay: time.Since(start) - due, kind: b.kind}
		data := b.data
		if *unique && b.kind == "image" {
			data = withComment(b.data, i)
		}
		req, _ := http.NewRequest("POST", *url, bytes.NewReader(data))
		req.Header.Set("Content-Type", b.ctype)
		atomic.AddInt64(&sent, 1)
		resp, err := client.Do(req)
		if err == nil {
			n, rerr := io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			r.status, r.size, r.cache = resp.StatusCode, int(n), resp.Header.Get("X-Cache")
			for k, name := range timingHeaders {
				r.timing[k] = resp.Header.Get(name)
			}
			err = rerr
		}
		if err != nil {
			r.err = err.Error()
		}
		r.latency = time.Since(start) - due
		statusMu.Lock()
		statuses[fmt.Sprint(r.status)]++
		statusMu.Unlock()
		rows <- r
	}

	var wg sync.WaitGroup
	if *rate > 0 {
		interval := time.Duration(float64(time.Second) / *rate)
		for i := 0; ; i++ {
			due := time.Duration(i) * interval
			if due >= *duration {
				break
			}
			if wait := due - time.Since(start); wait > 0 {
				time.Sleep(wait)
			}
			wg.Add(1)
			go func(i int, due time.Duration) { defer wg.Done(); send(i, due) }(i, due)
		}
	} else {
		var next int64 = -1
		for c := 0; c < *concurrency; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					due := time.Since(start)
					if due >= *duration {
						return
					}
					send(int(atomic.AddInt64(&next, 1)), due)
				}
			}()
		}
	}
	sendEnd := time.Since(start)
	wg.Wait()
	if *concurrency > 0 {
		sendEnd = *duration
	}
	close(rows)
	<-written
	summary := map[string]any{
		"duration_s": duration.Seconds(), "requests": sent, "send_window_s": sendEnd.Seconds(),
		"offered_per_s": *rate, "achieved_per_s": float64(sent) / sendEnd.Seconds(),
		"concurrency": *concurrency, "generator_cpu_s": cpuSeconds(), "wall_s": time.Since(start).Seconds(),
		"statuses": statuses, "unique": *unique,
	}
	json.NewEncoder(os.Stdout).Encode(summary)
}
