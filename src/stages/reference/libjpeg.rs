//! libjpeg-turbo's decompressor, called as Pillow's `libImaging/JpegDecode.c` calls it. This is
//! the only module of the stages with `unsafe` code: the C API of libjpeg, through `mozjpeg-sys`
//! 2.2.3 (mozjpeg 4.1, whose decompressor is libjpeg-turbo 2.1's, compiled from C by the `cc`
//! crate, without SIMD). Pillow 13's wheels ship libjpeg-turbo 3.2.0: the decoding paths used here
//! (islow IDCT, fancy upsampling, colour conversion, Huffman and arithmetic decoding) give the same
//! samples, which tests/it/decode.rs checks file by file.
//!
//! What Pillow does, and so what this does:
//! - the default decompression parameters of `jpeg_read_header` (islow integer IDCT, fancy chroma
//!   upsampling, block smoothing), only `out_color_space` set: greyscale for one component, RGB for
//!   three (libjpeg picks the file's colour space: YCbCr, or RGB for Adobe transform 0 and
//!   component ids R, G, B), CMYK for four (libjpeg converts YCCK, Adobe transform 2, to CMYK);
//! - a suspending data source fed as `ImageFile.load` feeds it: the file in blocks of
//!   [`PILLOW_BLOCK`] bytes, each libjpeg call that suspends retried with one more block. This
//!   matters twice: where libjpeg needs bytes past the end, Pillow reports "image file is
//!   truncated" (a missing EOI marker after the last row is accepted); and libjpeg's arithmetic
//!   decoder cannot suspend, so an arithmetic-coded scan that runs across a block boundary fails in
//!   Pillow ("broken data stream"), and fails here the same way (`JERR_CANT_SUSPEND`);
//! - warnings (corrupt data libjpeg can skip) are neither printed nor fatal;
//! - errors end the decoding with libjpeg's message. libjpeg's default `error_exit` calls `exit()`;
//!   Pillow longjmps out of it. Rust cannot longjmp, so `error_exit` unwinds instead (the
//!   `unwinding` feature of `mozjpeg-sys` compiles libjpeg with `-fexceptions` and declares its
//!   functions `C-unwind`) with `resume_unwind`, which skips the panic hook (nothing is printed),
//!   and [`decompress`] catches it. A build with `panic = "abort"` would abort on a corrupt JPEG.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_long, CStr};
use std::panic::{self, AssertUnwindSafe};

use mozjpeg_sys as ffi;

/// `ImageFile.MAXBLOCK`: the bytes `ImageFile.load` reads per call of the decoder.
pub(super) const PILLOW_BLOCK: usize = 65536;

/// `jpeg_read_header` return values (jpeglib.h).
const JPEG_SUSPENDED: c_int = 0;
const JPEG_HEADER_TABLES_ONLY: c_int = 2;

/// Samples as libjpeg writes them: `components` bytes per pixel (1 grey, 3 RGB, 4 CMYK), rows top
/// to bottom, no padding.
pub(super) struct Samples {
    pub width: u32,
    pub height: u32,
    pub components: usize,
    pub data: Vec<u8>,
}

/// Why libjpeg stopped.
#[derive(Debug)]
pub(super) enum Failure {
    /// The file ends where libjpeg needs more bytes.
    Truncated,
    /// A number of colour components Pillow does not open (it opens 1, 3 and 4).
    Components(c_int),
    /// A header with no pixels.
    Empty,
    /// The image is larger than the caller's bounds.
    TooLarge { width: u32, height: u32 },
    /// libjpeg's `error_exit`: its message code, its message template (a C format string) and the
    /// parameters libjpeg would format into it.
    Libjpeg {
        code: c_int,
        template: String,
        ints: [c_int; 8],
        text: String,
    },
}

/// The bounds [`decompress`] enforces before libjpeg allocates anything for the image.
pub(super) struct Bounds {
    pub max_side: u32,
    /// Largest sample buffer, and libjpeg's `max_memory_to_use` (its working memory, such as the
    /// coefficients of a progressive image).
    pub max_bytes: u64,
}

/// The data source: libjpeg's manager first (libjpeg sees only that part, through `cinfo.src`),
/// then where Pillow's feeding stands.
#[repr(C)]
struct Source {
    mgr: ffi::jpeg_source_mgr,
    /// The whole file.
    start: *const u8,
    len: usize,
    /// End of the bytes handed to libjpeg so far (Pillow's blocks read so far).
    window_end: usize,
    /// Bytes libjpeg asked to skip past the window (Pillow's `source->skip`).
    pending_skip: usize,
}

/// libjpeg's state: boxed so that the pointers between its parts stay valid.
struct Decoder {
    cinfo: ffi::jpeg_decompress_struct,
    err: ffi::jpeg_error_mgr,
    src: Source,
    created: bool,
}

impl Drop for Decoder {
    fn drop(&mut self) {
        if self.created {
            // SAFETY: `cinfo` was initialised by `jpeg_create_decompress`;
            // `jpeg_destroy_decompress` is what libjpeg documents after an error exit too (its
            // state may be mid-decode). It only frees libjpeg's pools and cannot fail.
            unsafe { ffi::jpeg_destroy_decompress(&mut self.cinfo) };
        }
    }
}

/// Decodes a whole JPEG file held in memory.
pub(super) fn decompress(data: &[u8], bounds: &Bounds) -> Result<Samples, Failure> {
    // SAFETY: these are plain C structs of integers, pointers and nullable function pointers, for
    // which all-zero is the state libjpeg expects before `jpeg_create_decompress` (it reads only
    // `err`, set below).
    let mut decoder: Box<Decoder> = Box::new(unsafe { std::mem::zeroed() });
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| run(&mut decoder, data, bounds)));
    match outcome {
        Ok(result) => result,
        Err(payload) => match payload.downcast::<Failure>() {
            Ok(failure) => Err(*failure),
            // Not libjpeg's unwind: a bug on this side; let it go on.
            Err(other) => panic::resume_unwind(other),
        },
    }
}

fn run(decoder: &mut Decoder, data: &[u8], bounds: &Bounds) -> Result<Samples, Failure> {
    let Decoder {
        cinfo,
        err,
        src,
        created,
    } = decoder;
    // SAFETY: `err` and `src` live in the same box as `cinfo` and outlive every libjpeg call
    // (libjpeg keeps pointers to both). Every libjpeg function below is called in the order its
    // manual requires (create, source, read_header, start, read_scanlines, finish), on `cinfo`
    // only; an error unwinds out of the call (see the module doc) and `Decoder::drop` destroys the
    // state. `data` outlives the decoder's use of it (the source only reads within its length).
    unsafe {
        let err: *mut ffi::jpeg_error_mgr = ffi::jpeg_std_error(err);
        (*err).error_exit = Some(error_exit);
        (*err).output_message = Some(output_message);
        cinfo.common.err = err;
        ffi::jpeg_create_decompress(cinfo);
        *created = true;
        (*cinfo.common.mem).max_memory_to_use =
            c_long::try_from(bounds.max_bytes).unwrap_or(c_long::MAX);

        src.start = data.as_ptr();
        src.len = data.len();
        src.window_end = data.len().min(PILLOW_BLOCK);
        src.mgr.next_input_byte = data.as_ptr();
        src.mgr.bytes_in_buffer = src.window_end;
        src.mgr.init_source = Some(init_source);
        src.mgr.fill_input_buffer = Some(fill_input_buffer);
        src.mgr.skip_input_data = Some(skip_input_data);
        src.mgr.resync_to_restart = Some(ffi::jpeg_resync_to_restart);
        src.mgr.term_source = Some(term_source);
        let src: *mut Source = src;
        cinfo.src = &mut (*src).mgr;

        // Pillow: `do ok = jpeg_read_header(FALSE) while (ok == JPEG_HEADER_TABLES_ONLY)`.
        loop {
            match ffi::jpeg_read_header(cinfo, 0) {
                JPEG_SUSPENDED => feed(&mut *src)?,
                JPEG_HEADER_TABLES_ONLY => continue,
                _ => break,
            }
        }
        cinfo.out_color_space = match cinfo.num_components {
            1 => ffi::J_COLOR_SPACE::JCS_GRAYSCALE,
            3 => ffi::J_COLOR_SPACE::JCS_RGB,
            4 => ffi::J_COLOR_SPACE::JCS_CMYK,
            n => return Err(Failure::Components(n)),
        };
        let (width, height) = (cinfo.image_width, cinfo.image_height);
        if width == 0 || height == 0 {
            return Err(Failure::Empty);
        }
        let components = cinfo.num_components as usize;
        let bytes = u64::from(width) * u64::from(height) * components as u64;
        if width > bounds.max_side || height > bounds.max_side || bytes > bounds.max_bytes {
            return Err(Failure::TooLarge { width, height });
        }
        while ffi::jpeg_start_decompress(cinfo) == 0 {
            feed(&mut *src)?;
        }
        // Unscaled output: the header's size, the requested number of components.
        let row_bytes = width as usize * components;
        let mut samples = vec![0u8; row_bytes * height as usize];
        for row in samples.chunks_exact_mut(row_bytes) {
            let mut rows = [row.as_mut_ptr()];
            while ffi::jpeg_read_scanlines(cinfo, rows.as_mut_ptr(), 1) != 1 {
                feed(&mut *src)?;
            }
        }
        // Pillow ignores a suspension here (every row is out): it only reads up to EOI.
        ffi::jpeg_finish_decompress(cinfo);
        Ok(Samples {
            width,
            height,
            components,
            data: samples,
        })
    }
}

/// `error_exit`: collects libjpeg's message and unwinds to [`decompress`].
unsafe extern "C-unwind" fn error_exit(cinfo: &mut ffi::jpeg_common_struct) {
    // SAFETY: libjpeg calls this with its own state, whose `err` is the manager set in `run`;
    // the message table holds `last_jpeg_message + 1` NUL-terminated strings (jerror.c), and
    // `msg_parm` is a union of 8 ints or an 80-byte NUL-terminated string (jpeglib.h).
    let failure = unsafe {
        let err = &mut *cinfo.err;
        let code = err.msg_code;
        let template = if code > 0 && code <= err.last_jpeg_message {
            CStr::from_ptr((*err.jpeg_message_table.add(code as usize)).cast())
                .to_string_lossy()
                .into_owned()
        } else {
            format!("libjpeg error {code}")
        };
        let ints = *err.msg_parm.i();
        let text = *err.msg_parm.s();
        let text = text.iter().take_while(|&&c| c != 0).map(|&c| c as u8);
        Failure::Libjpeg {
            code,
            template,
            ints,
            text: String::from_utf8_lossy(&text.collect::<Vec<u8>>()).into_owned(),
        }
    };
    panic::resume_unwind(Box::new(failure))
}

/// `output_message`: libjpeg's default prints warnings to stderr; Pillow's prints nothing.
unsafe extern "C-unwind" fn output_message(_cinfo: &mut ffi::jpeg_common_struct) {}

unsafe extern "C-unwind" fn init_source(_cinfo: &mut ffi::jpeg_decompress_struct) {}

unsafe extern "C-unwind" fn term_source(_cinfo: &mut ffi::jpeg_decompress_struct) {}

/// Pillow's next call after a suspension: one more block of the file after what libjpeg left
/// unconsumed, the pending skip applied first (a skip past it waits for the block after);
/// `Truncated` when the file has no more.
fn feed(src: &mut Source) -> Result<(), Failure> {
    loop {
        if src.window_end == src.len {
            return Err(Failure::Truncated);
        }
        src.window_end = src.len.min(src.window_end + PILLOW_BLOCK);
        // SAFETY: `next_input_byte` points into the file (`start..start + len`), at or before the
        // old window end.
        let consumed = unsafe { src.mgr.next_input_byte.offset_from(src.start) } as usize;
        let skip = src.pending_skip.min(src.window_end - consumed);
        src.pending_skip -= skip;
        // SAFETY: `consumed + skip <= window_end <= len`: inside the file.
        src.mgr.next_input_byte = unsafe { src.start.add(consumed + skip) };
        src.mgr.bytes_in_buffer = src.window_end - consumed - skip;
        if src.pending_skip == 0 {
            return Ok(());
        }
    }
}

/// No more bytes until the next block: returning FALSE suspends libjpeg, as Pillow's source does
/// (the arithmetic decoder, which cannot suspend, raises `JERR_CANT_SUSPEND` instead).
unsafe extern "C-unwind" fn fill_input_buffer(
    _cinfo: &mut ffi::jpeg_decompress_struct,
) -> ffi::boolean {
    0
}

/// Skips `num_bytes` (a marker libjpeg does not keep); past the window, consumes it and leaves the
/// rest for [`feed`], as Pillow's `skip_input_data` does.
unsafe extern "C-unwind" fn skip_input_data(
    cinfo: &mut ffi::jpeg_decompress_struct,
    num_bytes: c_long,
) {
    // SAFETY: `cinfo.src` is the `mgr` field of the `#[repr(C)]` `Source` set in `run` (its first
    // field, so the pointers are the same); advancing within `bytes_in_buffer` keeps
    // `next_input_byte` inside the window.
    unsafe {
        let src = &mut *cinfo.src.cast::<Source>();
        let wanted = usize::try_from(num_bytes).unwrap_or(0);
        let skip = wanted.min(src.mgr.bytes_in_buffer);
        src.mgr.next_input_byte = src.mgr.next_input_byte.add(skip);
        src.mgr.bytes_in_buffer -= skip;
        src.pending_skip = wanted - skip;
    }
}
